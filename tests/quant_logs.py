"""What two quant_log.json files of the same quantization may legitimately differ in, and a log without it."""

# wall-clock times, and how the run was carried out (resumed, how many ranks, on which host)
VOLATILE = frozenset({"time_s", "quantize_seconds", "sensitivity_seconds", "load_seconds", "block_read_seconds",
                      "block_read_ahead_seconds", "engine_phases", "resumed_at_layer", "world_size", "host"})


def strip_volatile(value, also=frozenset()):
    """`value` (parsed JSON) without the VOLATILE keys (and `also`) at any depth."""
    drop = VOLATILE | set(also)
    if isinstance(value, dict):
        return {k: strip_volatile(v, also) for k, v in value.items() if k not in drop}
    if isinstance(value, list):
        return [strip_volatile(v, also) for v in value]
    return value
