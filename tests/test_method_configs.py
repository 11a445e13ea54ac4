"""The method configs (quantkit/methods/configs.py) and what is generated from them: the quantize options and
their help, `quantkit methods`, preset checks, and the settings an artifact records."""

import json
from dataclasses import fields
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from quantkit.cli import METHOD_SETTINGS, main, quantize
from quantkit.errors import QuantkitError
from quantkit.methods import CONFIGS, make_method
from quantkit.methods.configs import GPTQConfig
from quantkit.methods.fields import flag_names, option_name, options, show

CONFIGS_DIR = Path(__file__).resolve().parents[1] / "configs"

# a valid value other than the default for every setting of every method
NON_DEFAULT = {
    "rtn": {"bits": 3, "group_size": 64, "sym": True, "clip_search": True},
    "gptq": {"bits": 3, "group_size": -1, "sym": True, "damp": 0.05, "act_order": False, "static_groups": False,
             "block_size": 64, "clip_search": False},
    "bcq": {"bits": 1, "group_size": 32, "offset": True, "solver": "weight", "rounds": 0, "refits": 2,
            "init": "uniform", "damp": 0.05, "act_order": False, "block_size": 64, "clip_search": False},
    "squeezellm": {"bits": 4, "sensitivity": "none", "table_refit": "output"},
    "anyprec": {"seed_bits": 2, "parent_bits": 5, "sensitivity": "fisher", "table_refit": "none", "upscale": "split",
                "refit_seed": True, "damp": 0.05, "act_order": False, "sweeps": 2, "band": 0.25},
    "ooc": {"low_bits": 3, "high_bits": 4, "clear_fraction": 0.25, "scan": 0.0, "group_size": 32, "sym": True,
            "damp": 0.1, "per_row": True, "block_size": 32, "act_order": False, "static_groups": False,
            "clip_search": False},
}


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def cli_args(settings):
    args = []
    for name, value in settings.items():
        f = METHOD_SETTINGS[name][0][1]
        args += [flag_names(f)[0 if value else 1]] if isinstance(value, bool) else [option_name(f), str(value)]
    return args


def bad_values(f):
    """Values the field must refuse."""
    if f.type is bool:
        return ["yes", 1]
    if "choices" in f.metadata:
        return ["nope"]
    allowed = f.metadata["allowed"]
    if f.type is float:
        return [-0.5, 1.5, "0.1", True]
    if ".." in allowed:
        low, high = (int(x) for x in allowed.split(".."))
        return [low - 1, high + 1, 4.0, True]
    return [-2, 1.5]


@pytest.fixture
def recorded(monkeypatch, tmp_path):
    """Runs `quantkit quantize` with the pipeline replaced: returns the settings the artifact would record
    (the pipeline records make_method(method, **settings).config())."""
    from quantkit import pipeline

    def fake(src, out, method, method_params, **kwargs):
        settings = make_method(method, **method_params).config()
        return {"out": out, "modules_quantized": 0, "method": method, "settings": settings, "quantize_seconds": 0}

    monkeypatch.setattr(pipeline, "quantize_checkpoint", fake)
    summary = tmp_path / "summary.json"

    def quantize_settings(*args):
        result = run("quantize", "--out", tmp_path / "unused", "--json", summary, *args)
        assert result.exit_code == 0, result.output
        return json.loads(summary.read_text())["settings"]

    return quantize_settings


def test_every_method_has_a_registered_config_and_implementation():
    assert list(CONFIGS) == ["rtn", "gptq", "bcq", "squeezellm", "anyprec", "ooc"]
    for name, cls in CONFIGS.items():
        method = make_method(name)
        assert method.name == name and method.config_class is cls
        assert method.config() == cls().as_dict()
        assert list(method.params) == [f.name for f in options(cls)]
        assert set(NON_DEFAULT[name]) == set(method.params), name  # new settings need a non-default example here


@pytest.mark.parametrize("name", list(CONFIGS))
def test_each_setting_refuses_bad_values_in_one_line(name):
    cls = CONFIGS[name]
    for f in options(cls):
        for value in bad_values(f):
            with pytest.raises(QuantkitError) as info:
                cls(**{f.name: value})
            message = str(info.value)
            assert "\n" not in message and repr(value) in message, message
            assert message.startswith(option_name(f) + " must be") or message.startswith(f"{f.name} (--"), message


@pytest.mark.parametrize("name,settings,fragment", [
    ("ooc", {"low_bits": 3, "high_bits": 2}, "--high-bits (2) must be at least --low-bits (3)"),
    ("anyprec", {"seed_bits": 4, "parent_bits": 3}, "--parent-bits 3 is below --seed-bits 4"),
    ("gptq", {"percdamp": 0.1}, "--method gptq does not take percdamp"),
    ("ooc", {"impl": "naive"}, "--method ooc does not take impl"),  # recorded, not a setting
    ("anyprec", {"level_weights": [1, 1]}, "--method anyprec does not take level_weights"),
])
def test_cross_setting_rules_and_unknown_settings(name, settings, fragment):
    with pytest.raises(QuantkitError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        make_method(name, **settings)


def test_make_method_from_a_config():
    assert make_method(GPTQConfig(bits=3, act_order=False)).config() == make_method("gptq", bits=3,
                                                                                    act_order=False).config()
    with pytest.raises(TypeError):
        make_method(GPTQConfig(), bits=3)


def test_recorded_settings_keep_their_order_and_fixed_values():
    assert list(make_method("ooc").config()) == ["low_bits", "high_bits", "clear_fraction", "scan", "group_size",
                                                 "sym", "damp", "per_row", "block_size", "act_order",
                                                 "static_groups", "clip_search", "impl"]
    assert make_method("ooc").config()["impl"] == "batch"
    assert list(make_method("anyprec").config())[:5] == ["seed_bits", "parent_bits", "sensitivity", "table_refit",
                                                         "upscale"]
    assert list(make_method("anyprec").config())[-1] == "level_weights"
    assert make_method("anyprec").config()["level_weights"] is None


@pytest.mark.parametrize("name", list(CONFIGS))
def test_cli_options_round_trip_to_the_recorded_settings(name, recorded):
    settings = NON_DEFAULT[name]
    cls = CONFIGS[name]
    assert all(settings[f.name] != f.default for f in options(cls))
    got = recorded("--method", name, *cli_args(settings))
    assert got == make_method(name, **settings).config() == cls(**settings).as_dict()
    assert recorded("--method", name) == cls().as_dict()  # no option given: the method's own defaults


def test_an_option_of_another_method_is_refused_by_name(tmp_path):
    for name, cls in CONFIGS.items():
        own = {f.name for f in options(cls)}
        foreign = next(s for s in METHOD_SETTINGS if s not in own)
        f = METHOD_SETTINGS[foreign][0][1]
        value = [] if f.type is bool else [NON_DEFAULT[METHOD_SETTINGS[foreign][0][0]][foreign]]
        result = run("quantize", "--method", name, option_name(f), *value, "--out", tmp_path / "q")
        assert result.exit_code == 2 and f"{option_name(f)} does not apply to --method {name}" in result.output


def test_quantize_help_names_every_methods_default():
    params = {p.name: p for p in quantize.params}
    for name, uses in METHOD_SETTINGS.items():
        text = params[name].help
        assert params[name].default is None, name  # an option not given keeps the method's default
        for method, f in uses:
            assert method in text and show(f, f.default) in text, (name, text)


def test_methods_json_lists_every_field():
    result = run("methods", "--json")
    assert result.exit_code == 0, result.output
    listed = {m["method"]: m for m in json.loads(result.output)["methods"]}
    assert list(listed) == list(CONFIGS)
    for name, cls in CONFIGS.items():
        rows = listed[name]["settings"]
        assert [r["name"] for r in rows] == [f.name for f in fields(cls)]
        for row, f in zip(rows, fields(cls)):
            assert row["default"] == f.default
            assert row["option"] == (None if f.metadata.get("fixed") else option_name(f))


def test_methods_table_shows_options_defaults_and_allowed_values():
    result = run("methods")
    assert result.exit_code == 0, result.output
    blocks = {block.split(":")[0]: block for block in result.output.strip().split("\n\n")}
    assert list(blocks) == list(CONFIGS)
    for name, cls in CONFIGS.items():
        for f in options(cls):
            line = next(line for line in blocks[name].splitlines() if line.strip().startswith(option_name(f)))
            assert show(f, f.default) in line and f.metadata["help"] in line


@pytest.mark.parametrize("preset", sorted(CONFIGS_DIR.glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_presets_are_valid(preset, recorded):
    values = yaml.safe_load(preset.read_text())
    settings = recorded("--preset", preset)
    method = values["method"]
    expected = {k.replace("-", "_"): v for k, v in values.items() if k.replace("-", "_") in METHOD_SETTINGS}
    assert settings == make_method(method, **expected).config()


@pytest.mark.parametrize("text,fragment", [
    ("method: ooc\nimpl: naive\n", "unknown option 'impl'"),
    ("method: anyprec\nlevel_weights: [1, 1]\n", "unknown option 'level_weights'"),
    ("method: gptq\nbits: 12\n", "p.yaml: --bits must be an integer in 2..8, got 12"),
    ("method: ooc\nscan: 1.5\n", "p.yaml: --scan must be a number in [0, 1], got 1.5"),
    ("method: squeezellm\nsensitivity: hessian\n", "sensitivity: 'hessian' is not one of"),
    ("method: rtn\ndamp: 0.1\n", "--damp does not apply to --method rtn"),
])
def test_bad_presets_are_refused_in_one_line(tmp_path, text, fragment):
    preset = tmp_path / "p.yaml"
    preset.write_text(text)
    result = run("quantize", "--preset", preset, "--out", tmp_path / "q")
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and fragment in lines[0], result.output
    assert not (tmp_path / "q").exists()
