"""Which any-precision matvec instance serves each (GPU, width, batch): the measured dispatch table.

CHOICES[gpu][bits][batch] names an entry of anyprec_gemm.CANDIDATES; a GPU, width or batch the table does
not name is served by today's kernel ("today"). `gpu` is matched as a substring of the device name
(torch.cuda.get_device_name), e.g. "H100" or "H200".

Written by benchmarks/anyprec_dispatch_table.py from the JSON of benchmarks/bench_anyprec_variants.py (old
and new instances against cuBLAS fp16 in one process, every shape, width 3..8, batch 1 and 8): a candidate
is named for (bits, batch) only where it was faster than today's kernel overall and slower on no measured
shape; batches 2..7 take it only where batch 1 and batch 8 chose the same one. Edit by rerunning that script.
"""

# SOURCES: the benchmark runs each GPU's entry came from (device, date, commit of the run)
SOURCES = {'H100': {'commit': '1ed0dc2', 'date': '2026-11-27', 'device': 'NVIDIA H100 80GB HBM3'}}

CHOICES = {'H100': {4: {1: 'pair_occ_t1'},
          5: {1: 'pair_t1'},
          7: {1: 'pair_occ_t1', 8: 'pair_occ'},
          8: {1: 'pair_occ_t1',
              2: 'pair_occ_t1',
              3: 'pair_occ_t1',
              4: 'pair_occ_t1',
              5: 'pair_occ_t1',
              6: 'pair_occ_t1',
              7: 'pair_occ_t1',
              8: 'pair_occ_t1'}}}


def choice(device_name, bits, batch):
    """The candidate name for this device, width and batch: the table's, else "today"."""
    for gpu, table in CHOICES.items():
        if gpu in device_name:
            return table.get(bits, {}).get(batch, "today")
    return "today"
