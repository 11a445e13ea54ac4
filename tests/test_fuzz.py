"""Property tests with seeded random loops (no hypothesis): bit packing round-trips for every width
and shape, and artifact loading under random damage to its metadata, which must end in a
QuantkitError naming what is wrong or in the very model that was written — never another exception
and never a different model."""

import json
import random
import shutil
import struct

import pytest
import torch

from quantkit.errors import QuantkitError
from quantkit.formats.anyprec import pack_bitplanes, unpack_bitplanes
from quantkit.formats.bcq import pack_planes, unpack_planes
from quantkit.formats.packing import pack_rows, unpack_rows, words_per_row
from quantkit.formats.uniform import UniformQuantizedTensor

# --- packing -------------------------------------------------------------------------------------

def reference_words(row, bits):
    """Frozen oracle: the row's codes as one LSB-first bitstream cut into 32-bit two's-complement words."""
    stream = 0
    for j, code in enumerate(row):
        stream |= int(code) << (j * bits)
    words = []
    for w in range(words_per_row(len(row), bits)):
        value = (stream >> (32 * w)) & 0xFFFFFFFF
        words.append(value - (1 << 32) if value >= 1 << 31 else value)
    return words


def random_shapes(rng, count):
    shapes = [(0, 7), (4, 0), (1, 1), (1, 31), (1, 32), (1, 33), (2, 64), (3, 96)]
    shapes += [(rng.randint(1, 9), rng.randint(1, 300)) for _ in range(count)]
    return shapes


@pytest.mark.parametrize("bits", range(1, 9))
def test_pack_rows_matches_the_bitstream_oracle(bits):
    rng = random.Random(bits)
    for rows, cols in random_shapes(rng, 25):
        gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
        # codes drawn from the whole range and from its ends, where sign and carry bugs live
        if rng.random() < 0.3:
            codes = torch.randint(0, 2, (rows, cols), generator=gen) * (2**bits - 1)
        else:
            codes = torch.randint(0, 2**bits, (rows, cols), generator=gen)
        packed = pack_rows(codes, bits)
        assert packed.dtype == torch.int32 and packed.shape == (rows, words_per_row(cols, bits))
        assert torch.equal(unpack_rows(packed, bits, cols).long(), codes), (bits, rows, cols)
        for r in range(min(rows, 3)):
            assert packed[r].tolist() == reference_words(codes[r].tolist(), bits), (bits, rows, cols)
        if cols and cols * bits % 32:  # padding bits of the last word are zero (kernels rely on it)
            pad = 32 - cols * bits % 32
            tail = packed[:, -1].to(torch.int64) & 0xFFFFFFFF
            assert torch.all(tail >> (32 - pad) == 0)


def test_unpack_refuses_a_word_count_that_does_not_fit():
    rng = random.Random(0)
    for _ in range(50):
        bits, cols = rng.randint(1, 8), rng.randint(1, 200)
        wrong = words_per_row(cols, bits) + rng.choice([-1, 1])
        if wrong < 0:
            continue
        with pytest.raises(ValueError, match="cannot hold"):
            unpack_rows(torch.zeros(2, wrong, dtype=torch.int32), bits, cols)


def test_uniform_tensor_state_roundtrip():
    rng = random.Random(1)
    for _ in range(40):
        bits, k, d = rng.randint(2, 8), rng.randint(1, 40), rng.randint(1, 150)
        g = rng.choice([d, rng.randint(1, d)])
        groups = (d + g - 1) // g
        sym = rng.random() < 0.5
        gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
        codes = torch.randint(0, 2**bits, (k, d), generator=gen)
        scales = torch.rand(k, groups, generator=gen) + 0.01
        zeros = torch.randint(0, 2**bits, (k, groups), generator=gen).float()
        qt = UniformQuantizedTensor.from_codes(codes, scales, zeros, bits, g, sym)
        again = UniformQuantizedTensor.from_state_dict(json.loads(json.dumps(qt.meta())), qt.state_dict())
        assert torch.equal(again.codes().long(), codes)
        if not sym:
            assert torch.equal(again.zeros(), zeros)
        assert torch.equal(again.dequantize(), qt.dequantize())
        assert again.bits_per_weight() == qt.bits_per_weight()


def test_bcq_and_anyprec_planes_roundtrip():
    rng = random.Random(2)
    for _ in range(40):
        q, k, d = rng.randint(1, 4), rng.randint(1, 20), rng.randint(1, 130)
        gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
        signs = torch.rand(q, k, d, generator=gen) < 0.5
        assert torch.equal(unpack_planes(pack_planes(signs), d), signs)
        bits = rng.randint(1, 8)
        codes = torch.randint(0, 2**bits, (k, d), generator=gen)
        planes = pack_bitplanes(codes, bits)
        assert torch.equal(unpack_bitplanes(planes, d).long(), codes)
        for b in range(1, bits + 1):  # a b-bit reader sees the top b bits of every code
            assert torch.equal(unpack_bitplanes(planes, d, b).long(), codes >> (bits - b))


# --- artifact loading under damage ---------------------------------------------------------------

@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    """A small rtn artifact in three shards, and the state of the model it loads to."""
    from factories import tiny_causal_lm
    from quantkit.artifact import float_tensors, write_artifact
    from quantkit.engine import quantize_model
    from quantkit.methods import make_method
    from quantkit.models import adapter_for
    from quantkit.runtime import load_quantized

    model = tiny_causal_lm(intermediate=128, seed=5)
    adapter = adapter_for(model)
    method = make_method("rtn", bits=3, group_size=32)
    qtensors, entries = quantize_model(model, adapter, method, None, progress=False)
    out = tmp_path_factory.mktemp("fuzz") / "art"
    write_artifact(out, model_config=model.config.to_dict(), tokenizer=None, qtensors=qtensors,
                   float_tensors=float_tensors(model, qtensors),
                   quantization_config={"method": "rtn", **method.config()}, quant_log={"modules": entries},
                   max_shard_bytes=25_000)
    assert len(list(out.glob("*.safetensors"))) >= 3
    return out, _state(load_quantized(out))


def _state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _same_state(a, b):
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def _paths(node, prefix=()):
    """Every path into a JSON tree (dict keys and list indices), the root excluded."""
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else []
    for key, child in items:
        yield prefix + (key,)
        yield from _paths(child, prefix + (key,))


def _mutate_json(rng, tree, focus=None):
    """One random edit somewhere in `tree` (under `focus` if given); returns a description."""
    paths = [p for p in _paths(tree) if focus is None or p[: len(focus)] == focus and len(p) > len(focus)]
    path = rng.choice(paths)
    parent = tree
    for key in path[:-1]:
        parent = parent[key]
    key, value = path[-1], parent[path[-1]]
    choices = ["delete", "null", "string", "list", "other_type"]
    if isinstance(value, bool):
        choices += ["flip"] * 3
    elif isinstance(value, int):
        choices += ["plus", "minus", "negate", "huge"]
    elif isinstance(value, float):
        choices += ["double", "nan"]
    elif isinstance(value, str):
        choices += ["append", "empty"]
    elif isinstance(value, (dict, list)) and value:
        choices += ["drop_child", "empty"]
    op = rng.choice(choices)
    new = {"null": None, "string": str(value) + "x", "list": [value], "other_type": {"x": 1}, "flip": not value,
           "plus": value + 1 if isinstance(value, (int, float)) else None,
           "minus": value - 1 if isinstance(value, (int, float)) else None,
           "negate": -value if isinstance(value, (int, float)) else None, "huge": 10**12,
           "double": value * 2 if isinstance(value, (int, float)) else None, "nan": float("nan"),
           "append": f"{value}!", "empty": type(value)()}
    if op == "delete":
        del parent[key]
    elif op == "drop_child":
        victim = rng.choice(list(value)) if isinstance(value, dict) else rng.randrange(len(value))
        del value[victim]
    else:
        parent[key] = new[op]
    return f"{op} at {'/'.join(map(str, path))}"


def _damage_config(rng, root):
    path = root / "config.json"
    text = path.read_text()
    kind = rng.choice(["json", "json", "json", "qcfg", "qcfg", "modules", "bytes", "truncate"])
    if kind == "bytes":
        data = bytearray(text.encode())
        i = rng.randrange(len(data))
        data[i] = rng.randrange(256)
        path.write_bytes(bytes(data))
        return f"config.json byte {i} := {data[i]}"
    if kind == "truncate":
        cut = rng.randrange(len(text))
        path.write_text(text[:cut])
        return f"config.json cut at {cut}"
    config = json.loads(text)
    focus = {"json": None, "qcfg": ("quantization_config",), "modules": ("quantization_config", "modules")}[kind]
    what = _mutate_json(rng, config, focus)
    path.write_text(json.dumps(config, indent=rng.choice([None, 2])))
    return f"config.json {what}"


def _read_st(path):
    data = path.read_bytes()
    (size,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + size]), data[8 + size :]


def _write_st(path, header, body, pad=True):
    text = json.dumps(header, separators=(",", ":")).encode()
    if pad:
        text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + body)


def _damage_header(rng, root):
    shard = rng.choice(sorted(root.glob("*.safetensors")))
    header, body = _read_st(shard)
    kind = rng.choice(["entry", "entry", "entry", "metadata", "swap", "rename", "length", "header_byte"])
    if kind == "swap" and len(header) < 3:  # needs two tensors besides __metadata__
        kind = "rename"
    if kind == "entry":
        name = rng.choice([n for n in header if n != "__metadata__"])
        what = _mutate_json(rng, header, (name,))
    elif kind == "metadata":
        what = _mutate_json(rng, header, ("__metadata__",))
    elif kind == "swap":  # two tensors trade places in the file: sizes may even agree
        a, b = rng.sample([n for n in header if n != "__metadata__"], 2)
        header[a]["data_offsets"], header[b]["data_offsets"] = header[b]["data_offsets"], header[a]["data_offsets"]
        what = f"swap offsets of {a} and {b}"
    elif kind == "rename":
        name = rng.choice([n for n in header if n != "__metadata__"])
        header[name + "_"] = header.pop(name)
        what = f"rename {name}"
    elif kind == "length":
        data = bytearray(shard.read_bytes())
        value = rng.choice([0, 1, 7, len(data), 2**40, struct.unpack("<Q", data[:8])[0] + rng.choice([-8, 8])])
        data[:8] = struct.pack("<Q", value)
        shard.write_bytes(bytes(data))
        return f"{shard.name}: header length := {value}"
    else:
        data = bytearray(shard.read_bytes())
        i = rng.randrange(8, 8 + struct.unpack("<Q", data[:8])[0])
        data[i] = rng.randrange(32, 127)
        shard.write_bytes(bytes(data))
        return f"{shard.name}: header byte {i} := {chr(data[i])!r}"
    _write_st(shard, header, body)
    return f"{shard.name}: {what}"


def _damage_data(rng, root):
    shard = rng.choice(sorted(root.glob("*.safetensors")))
    data = bytearray(shard.read_bytes())
    start = 8 + struct.unpack("<Q", data[:8])[0]
    i = rng.randrange(start, len(data))
    data[i] ^= 1 << rng.randrange(8)
    shard.write_bytes(bytes(data))
    return f"{shard.name}: data byte {i} flipped"


def _check_load(root, verify, original, what):
    from quantkit.runtime import load_quantized

    try:
        model = load_quantized(root, verify=verify)
    except QuantkitError as exc:
        message = str(exc)
        assert message and "\n" not in message, (what, message)
        assert str(root) in message or "config.json" in message, (what, message)
        return "refused"
    except Exception as exc:  # the property under test: nothing but a QuantkitError escapes
        raise AssertionError(f"{what} (verify={verify}): {type(exc).__name__}: {exc}") from exc
    assert _same_state(_state(model), original), f"{what} (verify={verify}) loaded a different model"
    return "identical"


@pytest.mark.parametrize("damage,seed", [(d, s) for d in ("config", "header") for s in range(3)])
def test_damaged_metadata_is_refused_or_harmless(artifact, tmp_path, damage, seed):
    src, original = artifact
    rng = random.Random(f"{damage}-{seed}")
    outcomes = {"refused": 0, "identical": 0}
    for i in range(20):
        root = tmp_path / f"a{i}"
        shutil.copytree(src, root)
        what = (_damage_config if damage == "config" else _damage_header)(rng, root)
        outcomes[_check_load(root, False, original, what)] += 1
        outcomes[_check_load(root, True, original, what)] += 1
        shutil.rmtree(root)
    assert outcomes["refused"] > 0


def test_damaged_tensor_bytes_are_refused_when_verifying(artifact, tmp_path):
    src, original = artifact
    rng = random.Random(7)
    for i in range(10):
        root = tmp_path / f"a{i}"
        shutil.copytree(src, root)
        what = _damage_data(rng, root)
        assert _check_load(root, True, original, what) == "refused", what
        shutil.rmtree(root)
