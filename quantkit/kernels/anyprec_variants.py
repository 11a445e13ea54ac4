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
was at least 2 % faster than today's kernel on that shape; batches 2..7 take it only where batch 1 and batch 8
of that shape chose the same one. Edit by rerunning that script.
"""

import math

# SOURCES: the benchmark runs each GPU's entry came from (device, date, commits of the runs)
SOURCES = {'H100': {'commits': ['1ed0dc2+changes'], 'date': '2026-11-27', 'device': 'NVIDIA H100 80GB HBM3', 'runs': 2}}

CHOICES = {'H100': {(4096, 4096): {4: {8: 'pair_occ'},
                         5: {1: 'pair'},
                         6: {1: 'pair_occ',
                             2: 'pair_occ',
                             3: 'pair_occ',
                             4: 'pair_occ',
                             5: 'pair_occ',
                             6: 'pair_occ',
                             7: 'pair_occ',
                             8: 'pair_occ'},
                         8: {1: 'rows_occ'}},
          (4096, 11008): {4: {1: 'pair_occ'},
                          5: {1: 'rows',
                              2: 'rows',
                              3: 'rows',
                              4: 'rows',
                              5: 'rows',
                              6: 'rows',
                              7: 'rows',
                              8: 'rows'},
                          6: {1: 'rows_occ', 8: 'rows'},
                          8: {1: 'rows_occ',
                              2: 'rows_occ',
                              3: 'rows_occ',
                              4: 'rows_occ',
                              5: 'rows_occ',
                              6: 'rows_occ',
                              7: 'rows_occ',
                              8: 'rows_occ'}},
          (8192, 28672): {4: {1: 'pair_occ'},
                          5: {1: 'rows_s1',
                              2: 'rows_s1',
                              3: 'rows_s1',
                              4: 'rows_s1',
                              5: 'rows_s1',
                              6: 'rows_s1',
                              7: 'rows_s1',
                              8: 'rows_s1'},
                          6: {1: 'rows_occ', 8: 'rows_s1'},
                          7: {1: 'rows_s1',
                              2: 'rows_s1',
                              3: 'rows_s1',
                              4: 'rows_s1',
                              5: 'rows_s1',
                              6: 'rows_s1',
                              7: 'rows_s1',
                              8: 'rows_s1'},
                          8: {1: 'rows',
                              2: 'rows',
                              3: 'rows',
                              4: 'rows',
                              5: 'rows',
                              6: 'rows',
                              7: 'rows',
                              8: 'rows'}},
          (11008, 4096): {4: {1: 'rows'},
                          5: {1: 'rows', 8: 'pair'},
                          6: {1: 'rows_occ', 8: 'rows'},
                          7: {1: 'rows', 8: 'rows_s1'},
                          8: {1: 'rows_occ', 8: 'rows_s1'}},
          (14336, 4096): {4: {1: 'rows_s1'},
                          5: {1: 'rows_s1',
                              2: 'rows_s1',
                              3: 'rows_s1',
                              4: 'rows_s1',
                              5: 'rows_s1',
                              6: 'rows_s1',
                              7: 'rows_s1',
                              8: 'rows_s1'},
                          6: {1: 'rows_s1',
                              2: 'rows_s1',
                              3: 'rows_s1',
                              4: 'rows_s1',
                              5: 'rows_s1',
                              6: 'rows_s1',
                              7: 'rows_s1',
                              8: 'rows_s1'},
                          7: {1: 'rows_s1',
                              2: 'rows_s1',
                              3: 'rows_s1',
                              4: 'rows_s1',
                              5: 'rows_s1',
                              6: 'rows_s1',
                              7: 'rows_s1',
                              8: 'rows_s1'},
                          8: {1: 'rows_s1',
                              2: 'rows_s1',
                              3: 'rows_s1',
                              4: 'rows_s1',
                              5: 'rows_s1',
                              6: 'rows_s1',
                              7: 'rows_s1',
                              8: 'rows_s1'}},
          (28672, 8192): {4: {1: 'pair_occ'},
                          5: {1: 'rows', 8: 'pair'},
                          6: {1: 'rows_occ'},
                          7: {1: 'rows',
                              2: 'rows',
                              3: 'rows',
                              4: 'rows',
                              5: 'rows',
                              6: 'rows',
                              7: 'rows',
                              8: 'rows'},
                          8: {1: 'rows',
                              2: 'rows',
                              3: 'rows',
                              4: 'rows',
                              5: 'rows',
                              6: 'rows',
                              7: 'rows',
                              8: 'rows'}},
          (49152, 12288): {4: {1: 'rows'},
                           5: {1: 'rows', 8: 'pair'},
                           6: {1: 'rows_occ', 8: 'rows'},
                           7: {1: 'rows',
                               2: 'rows',
                               3: 'rows',
                               4: 'rows',
                               5: 'rows',
                               6: 'rows',
                               7: 'rows',
                               8: 'rows'},
                           8: {1: 'rows',
                               2: 'rows',
                               3: 'rows',
                               4: 'rows',
                               5: 'rows',
                               6: 'rows',
                               7: 'rows',
                               8: 'rows'}}}}


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
    cols = in_features): the table's, else "today"."""
    for gpu, table in CHOICES.items():
        if gpu in device_name:
            cls = shape_class(table, rows, cols)
            return "today" if cls is None else table[cls].get(bits, {}).get(batch, "today")
    return "today"
