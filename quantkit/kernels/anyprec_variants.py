"""Which any-precision matvec instance serves each (GPU, shape class, width, batch): the measured dispatch table.

CHOICES[gpu][(rows, cols)][bits][batch] names an entry of anyprec_gemm.CANDIDATES. Its keys (rows, cols) are
the shapes the benchmark measured on that GPU (out_features x in_features), each a shape class: a module of
shape (M, N) belongs to the measured shape nearest it in log space, (log M - log rows)^2 + (log N - log cols)^2
smallest (ties to the first in sorted order), provided that shape is within a factor of 2 of it in both rows
and columns; a module near no measured shape, a GPU, width or batch the table does not name is served by
today's kernel ("today"). `gpu` is matched as a substring of the device name (torch.cuda.get_device_name).

Written by benchmarks/anyprec_dispatch_table.py from the JSON of benchmarks/bench_anyprec_variants.py runs
(old and new instances against cuBLAS fp16 in one process, every shape, width 3..8, batch 1 and 8; several
runs combined by each candidate's slowest time): a candidate is named for a (shape, width, batch) only where it
was at least 2 % faster than today's kernel on that shape. Batches 2..7, not measured, are not in the table:
`choice` serves them the instance batch 1 and batch 8 of that shape both name, else today's kernel. Edit by
rerunning that script.
"""

import math

# SOURCES: the benchmark runs each GPU's entry came from (device, date, commits of the runs;
# under 'widths', the runs that decided those widths)
SOURCES = {'H100': {'commits': ['1ed0dc2+changes'],
          'date': '2026-11-27',
          'device': 'NVIDIA H100 80GB HBM3',
          'runs': 2,
          'widths': {4: {'commits': ['368c703'],
                         'date': '2026-11-27',
                         'device': 'NVIDIA H100 80GB HBM3',
                         'min_gain': 0.02,
                         'runs': 3}}},
 'H200': {'commits': ['03dee6a+changes'],
          'date': '2026-11-27',
          'device': 'NVIDIA H200',
          'runs': 1,
          'widths': {4: {'commits': ['c158251'],
                         'date': '2026-11-27',
                         'device': 'NVIDIA H200',
                         'min_gain': 0.05,
                         'runs': 1}}}}

CHOICES = {'H100': {(4096, 4096): {4: {1: 'rows_pairs_s2', 8: 'rows_pairs_s2'},
                         5: {1: 'pair'},
                         6: {1: 'pair_occ', 8: 'pair_occ'},
                         8: {1: 'rows_occ'}},
          (4096, 11008): {4: {1: 'rows_pairs_s2', 8: 'rows_pairs_s2'},
                          5: {1: 'rows', 8: 'rows'},
                          6: {1: 'rows_occ', 8: 'rows'},
                          8: {1: 'rows_occ', 8: 'rows_occ'}},
          (8192, 28672): {4: {1: 'rows_pairs_s2', 8: 'rows_pairs_s2'},
                          5: {1: 'rows_s1', 8: 'rows_s1'},
                          6: {1: 'rows_occ', 8: 'rows_s1'},
                          7: {1: 'rows_s1', 8: 'rows_s1'},
                          8: {1: 'rows', 8: 'rows'}},
          (11008, 4096): {4: {1: 'rows_pairs_s1'},
                          5: {1: 'rows', 8: 'pair'},
                          6: {1: 'rows_occ', 8: 'rows'},
                          7: {1: 'rows', 8: 'rows_s1'},
                          8: {1: 'rows_occ', 8: 'rows_s1'}},
          (14336, 4096): {4: {1: 'rows_pairs_s1', 8: 'rows_pairs_s1'},
                          5: {1: 'rows_s1', 8: 'rows_s1'},
                          6: {1: 'rows_s1', 8: 'rows_s1'},
                          7: {1: 'rows_s1', 8: 'rows_s1'},
                          8: {1: 'rows_s1', 8: 'rows_s1'}},
          (28672, 8192): {4: {1: 'rows_pairs', 8: 'rows_pairs_s2'},
                          5: {1: 'rows', 8: 'pair'},
                          6: {1: 'rows_occ'},
                          7: {1: 'rows', 8: 'rows'},
                          8: {1: 'rows', 8: 'rows'}},
          (49152, 12288): {4: {1: 'rows_pairs', 8: 'rows_pairs'},
                           5: {1: 'rows', 8: 'pair'},
                           6: {1: 'rows_occ', 8: 'rows'},
                           7: {1: 'rows', 8: 'rows'},
                           8: {1: 'rows', 8: 'rows'}}},
 'H200': {(4096, 4096): {4: {1: 'rows_pairs_s2', 8: 'rows_pairs_s2'}, 5: {1: 'pair'}},
          (4096, 11008): {4: {1: 'rows_pairs_s2', 8: 'rows_pairs_s2'},
                          5: {1: 'rows', 8: 'rows'},
                          8: {1: 'rows_occ', 8: 'rows_occ'}},
          (8192, 28672): {4: {1: 'rows_pairs_s2', 8: 'rows_pairs_s2'},
                          5: {1: 'rows_s1'},
                          6: {8: 'rows_s1'},
                          7: {1: 'rows_s1', 8: 'rows_s1'},
                          8: {1: 'rows', 8: 'rows'}},
          (11008, 4096): {4: {1: 'rows_pairs_s1'},
                          5: {1: 'rows', 8: 'pair'},
                          6: {1: 'rows_occ', 8: 'rows'},
                          7: {1: 'rows', 8: 'rows'},
                          8: {1: 'rows_occ', 8: 'rows_s1'}},
          (14336, 4096): {4: {1: 'rows_pairs_s1', 8: 'rows_pairs_s1'},
                          5: {1: 'rows_s1', 8: 'rows_s1'},
                          6: {1: 'rows_s1', 8: 'rows_s1'},
                          7: {1: 'rows_s1', 8: 'rows_s1'},
                          8: {1: 'rows_s1', 8: 'rows_s1'}},
          (28672, 8192): {4: {1: 'rows_pairs', 8: 'rows_pairs_s2'},
                          5: {1: 'rows'},
                          6: {1: 'rows_occ'},
                          7: {1: 'rows', 8: 'rows'},
                          8: {1: 'rows', 8: 'rows'}},
          (49152, 12288): {4: {1: 'rows_pairs', 8: 'rows_pairs'},
                           5: {1: 'rows'},
                           6: {1: 'rows_occ', 8: 'rows'},
                           7: {1: 'rows', 8: 'rows'},
                           8: {1: 'rows', 8: 'rows'}}}}


def shape_class(shapes, rows, cols):
    """The measured shape of `shapes` whose class (rows, cols) belongs to, or None (see the module's text)."""
    best, best_d = None, math.inf
    for r, c in sorted(shapes):
        dr, dc = math.log(rows / r), math.log(cols / c)
        if max(abs(dr), abs(dc)) > math.log(2) + 1e-9:
            continue
        d = dr * dr + dc * dc
        if d < best_d:
            best, best_d = (r, c), d
    return best


def choice(device_name, bits, batch, rows, cols):
    """The candidate name for this device, width, batch and module shape (rows = out_features,
    cols = in_features): the table's; for a batch between 1 and 8 it does not name, the one batch 1 and 8
    share; else "today"."""
    for gpu, table in CHOICES.items():
        if gpu in device_name:
            cls = shape_class(table, rows, cols)
            per_batch = {} if cls is None else table[cls].get(bits, {})
            if batch not in per_batch and 1 < batch < 8 and per_batch.get(1) == per_batch.get(8):
                batch = 1
            return per_batch.get(batch, "today")
    return "today"
