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
SOURCES = {}

CHOICES = {}


def choice(device_name, bits, batch):
    """The candidate name for this device, width and batch: the table's, else "today"."""
    for gpu, table in CHOICES.items():
        if gpu in device_name:
            return table.get(bits, {}).get(batch, "today")
    return "today"
