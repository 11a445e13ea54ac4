"""Bit families (k-OOC paper, section 3.1, table 4, appendix A): the average number of bits a
quantized weight really costs, A = M (mark bits) + F (flag bits: scales, zeros, means) + B (code
bits), per element of a [k, d] matrix, with f = 16-bit flags. A_lim is the limit d -> inf and
A_max the worst case over the matrices of a model (smallest d).

Formulas, as in the paper unless noted:
  GPTQ(b), group g:        A = b + (b + f)/g                       (zero point b bits + fp16 scale)
  PB-LLM(h, l, p):         A = 1 + 2f/g + (h + f)/d + p·h + (1-p)·l
  BiLLM(h, l, p):          A = (2 - p) + (h + 2l)·f/g + p·h + (1-p)·1
                           (low tier binarized, 1 bit, as the paper's worked figure 3.75 uses;
                           table 4's "(1-p)·l" would give 4.65 for BiLLM(2,2,0.1))
  OOC / GPTQ(h, l, p):     eq. (4): (l+f)/g + l + [2(h+f) + p·g·h - (l+f) - l·p·g]/d
                           (stored "ooc" modules: ooc_meta_bits, eq. (4) plus its stated extras)
  BCQ(q, g[, offset]):     A = q + (q·f [+ f])/g                   (q fp16 scales per group, opt. offset)
  codebook(b) per channel: A = b + 2^b·f/d                         (SqueezeLLM / any-precision LUT)
  any-precision seed..n:   A = n + Σ_{b=seed..n} 2^b·f/d (stored);  b + 2^b·f/d read when serving b
Measured bits (`bitfamily DIR`) come from the stored bytes of every tensor of each quantized
module; the matching formula uses the exact group count ceil(d/g) of our layout.
"""

import math
from pathlib import Path

from quantkit.artifact import open_tensor_file, read_config, verify_files

FLAG_BITS = 16


def groups_per_weight(g, d=None):
    """1/g in the limit; with d, the exact ceil(d/g) groups of a row (a partial last group counts)."""
    return 1 / g if d is None else math.ceil(d / g) / d


def gptq_bits(b, g, d=None, f=FLAG_BITS, zero_bits=None):
    """A for GPTQ(b)/RTN with groups of g; d given: exact ceil(d/g) groups (partial last group)."""
    zero_bits = b if zero_bits is None else zero_bits
    return b + (zero_bits + f) * groups_per_weight(g, d)


def pbllm_bits(h, l, p, g, d=None, f=FLAG_BITS):
    high_flags = 0 if d is None else (h + f) / d
    return 1 + 2 * f * groups_per_weight(g, d) + high_flags + p * h + (1 - p) * l


def billm_bits(h, l, p, g, d=None, f=FLAG_BITS):
    return (2 - p) + (h + 2 * l) * f * groups_per_weight(g, d) + p * h + (1 - p) * 1


def ooc_bits(h, l, p, g, d=None, f=FLAG_BITS):
    base = (l + f) / g + l
    if d is None:
        return base
    return base + (2 * (h + f) + p * g * h - (l + f) - l * p * g) / d


def ooc_meta_bits(meta: dict, f=FLAG_BITS):
    """Bits per weight of a stored "ooc" module (formats/ooc.py): eq. (4) with p = n_clear/g and the
    exact group count, plus what eq. (4) leaves out, all exact:
      - (l - h)/d: eq. (4) counts the odd group's low zero point at h bits, we store it at l bits;
      - 16·C·n/(k·d): the clear-column table (C = 1 per matrix; C candidates per row) [32 bits if d > 32767];
      - 8/d (uint8, C <= 256) or 16/d per row: the per-row choice of list;
      - packing padding: every packed row of codes/zeros is rounded up to 32 bits.
    Symmetric storage has no zero points: the l-bit zero of every group and the h-bit odd zero drop out."""
    from quantkit.formats.ooc import ooc_stored_bits

    k, d = meta["out_features"], meta["in_features"]
    return ooc_stored_bits(k, d, meta["low_bits"], meta["high_bits"], meta["group_size"], meta["n_clear"],
                           meta["n_lists"], meta["per_row"], meta["sym"]) / (k * d)


def ooc_eq4_exact(h, l, n, g, d, f=FLAG_BITS):
    """eq. (4) with the exact group count ceil(d/g) and n = p·g clear columns: bits per weight."""
    groups = math.ceil(d / g)
    return ((groups - 1) * (l + f) + 2 * (h + f) + n * h + (d - n) * l) / d


def bcq_bits(q, g, offset=False, d=None, f=FLAG_BITS):
    return q + (q * f + (f if offset else 0)) * groups_per_weight(g, d)


def codebook_bits(b, d=None, f=FLAG_BITS):
    return b if d is None else b + (2**b) * f / d


def anyprec_bits(seed, parent, d=None, f=FLAG_BITS):
    """Stored bits of an any-precision matrix (formats/anyprec.py): parent planes (padded to 32
    columns per row) + one per-row fp16 table of 2^b entries for every b in seed..parent."""
    if d is None:
        return parent
    return (parent * 32 * math.ceil(d / 32) + sum(2**b * f for b in range(seed, parent + 1))) / d


def anyprec_read_bits(bits, d=None, f=FLAG_BITS):
    """Bits per weight read when serving `bits` from an any-precision matrix: top planes + that table."""
    return bits if d is None else (bits * 32 * math.ceil(d / 32) + 2**bits * f) / d


def formula_table(g=128, d_min=768, f=FLAG_BITS):
    """The paper's reference rows: A_lim and A_max (at d = d_min, with the exact group count ceil(d/g),
    so a d_min that g does not divide, e.g. SmolLM2's 576, counts its partial group) for each family."""
    rows = []

    def add(name, lim, at_dmin, note=""):
        rows.append({"scheme": name, "A_lim": lim, "A_max": max(lim, at_dmin), "note": note})

    for b in (2, 3, 4, 8):
        add(f"GPTQ({b})", gptq_bits(b, g, f=f), gptq_bits(b, g, d_min, f), "zero point b bits + fp16 scale per group")
    add("PB-LLM(8,1,0.1)", pbllm_bits(8, 1, 0.1, g, f=f), pbllm_bits(8, 1, 0.1, g, d_min, f),
        "table-4 formula; the paper's text quotes 2.75")
    add("BiLLM(2,2,0.1)", billm_bits(2, 2, 0.1, g, f=f), billm_bits(2, 2, 0.1, g, d_min, f),
        "low tier binarized (1 bit)")
    for h, l in ((2, 2), (3, 2), (4, 2), (4, 3)):
        # eq. (4) at d_min counts d/g groups; ooc_eq4_exact is the same formula with ceil(d/g) of them
        add(f"OOC({h},{l},0.1)", ooc_bits(h, l, 0.1, g, f=f), ooc_eq4_exact(h, l, 0.1 * g, g, d_min, f), "eq. (4)")
    for q in (2, 3, 4):
        add(f"BCQ({q})", bcq_bits(q, g, f=f), bcq_bits(q, g, d=d_min, f=f), "q fp16 scales per group")
        add(f"BCQ({q})+offset", bcq_bits(q, g, True, f=f), bcq_bits(q, g, True, d_min, f),
            "plus an fp16 offset per group")
    for b in (3, 4, 8):
        add(f"codebook({b})", codebook_bits(b, f=f), codebook_bits(b, d_min, f), "per-channel fp16 LUT of 2^b entries")
    return {"group_size": g, "d_min": d_min, "flag_bits": f, "rows": rows}


def formula_for_meta(meta: dict):
    """Formula value (bits per weight) for one stored module, from its format meta; None if unknown."""
    fmt = meta.get("format")
    d, k = meta["in_features"], meta["out_features"]
    if fmt == "uniform":
        value = gptq_bits(meta["bits"], meta["group_size"], d, zero_bits=0 if meta["sym"] else meta["bits"])
        return value + (32 / k if meta.get("has_g_idx") else 0.0)
    if fmt == "bcq":
        # planes are padded to 32 columns per row (formats/bcq.py): equal to the stored bits when d % 32 == 0
        return bcq_bits(meta["bits"], meta["group_size"], meta["offset"], d)
    if fmt == "anyprec":
        # equals codebook_bits(b, d) for a SqueezeLLM tensor (seed == parent) when d % 32 == 0
        return anyprec_bits(meta["seed_bits"], meta["parent_bits"], d)
    if fmt == "ooc":
        return ooc_meta_bits(meta)
    return None


_DTYPE_BITS = {"F16": 16, "BF16": 16, "F32": 32, "I32": 32, "I64": 64, "U8": 8, "I8": 8, "I16": 16, "BOOL": 8}


def measured_bits(artifact_dir, verify=True) -> dict:
    """Bits per weight of every quantized module from the stored tensors' headers; the files' checksums
    are checked first unless verify=False."""
    artifact_dir = Path(artifact_dir)
    qcfg = read_config(artifact_dir)["quantization_config"]
    if verify:
        verify_files(artifact_dir, qcfg)
    modules = qcfg["modules"]
    stored = {name: 0 for name in modules}
    for fname in qcfg["files"]:
        with open_tensor_file(artifact_dir / fname) as fh:
            for key in fh.keys():
                module, _, short = key.rpartition(".")
                if module in stored and short != "bias":
                    sl = fh.get_slice(key)
                    stored[module] += math.prod(sl.get_shape()) * _DTYPE_BITS[sl.get_dtype()]
    rows, total_bits, total_weights = [], 0, 0
    for name, meta in modules.items():
        numel = meta["in_features"] * meta["out_features"]
        total_bits += stored[name]
        total_weights += numel
        rows.append({"module": name, "shape": [meta["out_features"], meta["in_features"]], "format": meta["format"],
                     "stored_bits": stored[name], "bits_per_weight": stored[name] / numel,
                     "formula": formula_for_meta(meta)})
        if meta["format"] == "anyprec":  # what serving each stored width reads
            rows[-1]["read_bits"] = {b: anyprec_read_bits(b, meta["in_features"])
                                     for b in range(meta["seed_bits"], meta["parent_bits"] + 1)}
    report = {"artifact": str(artifact_dir), "method": qcfg.get("method"), "modules": rows,
              "bits_per_weight": total_bits / total_weights if total_weights else float("nan"),
              "quantized_weights": total_weights, "stored_bits": total_bits}
    if rows and all("read_bits" in r for r in rows):
        widths = rows[0]["read_bits"].keys()
        report["read_bits_per_weight"] = {
            b: sum(r["read_bits"][b] * r["shape"][0] * r["shape"][1] for r in rows) / total_weights for b in widths}
    return report
