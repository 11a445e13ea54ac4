"""Layer checkpoints of a running quantization, so that a killed run continues with `--resume`.

The directory <out>.partial/ (next to the artifact it will become) holds:
  state.json                       the commit point: fingerprint of the settings, layers done, the
                                   layer files with their sha256, the input files of the next layer
  layer-00007.safetensors          the quantized tensors of layer 7 (as in the artifact: `m.qweight`,
                                   ...); header metadata: each module's meta and the layer's log entries
  inputs-00008-0000000.safetensors the next layer's input activations of windows [0, stop) (one file
                                   per rank; header metadata: start, stop); only with calibration
After layer i every file is written under a temporary name and renamed, then state.json is replaced
(rename) — so a kill at any moment leaves the last committed state valid — and only then are the
previous layer's input files deleted. The quantized layers are the same tensors the artifact will
hold, and the next layer's inputs are exactly the activations an uninterrupted run would carry on
with (the engine is deterministic), so a resumed run writes a byte-identical artifact. RNG state is
not needed: calibration windows come from the seed and nothing else is random.

Disk cost: the quantized layers (the size of the final artifact's tensors, once) plus, at any moment,
two sets of next-layer activations: nsamples × seqlen × hidden × dtype bytes each (Llama-2-7B,
128 × 2048 × 4096 fp16 = 2 GiB), i.e. about 2 GiB written per layer. `--no-checkpoint` turns it off.
Files are renamed, not fsync'ed: this protects against the process being killed, not a power loss.
"""

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from quantkit.artifact import file_digest
from quantkit.errors import CheckpointError, StorageError
from quantkit.tensorfile import TensorBytes, write_tensor_file

STATE = "state.json"
FORMAT = "quantkit-checkpoint"
VERSION = 1


def checkpoint_dir(out) -> Path:
    out = Path(out)
    return out.with_name(out.name + ".partial")


def _layer_file(index):
    return f"layer-{index:05d}.safetensors"


def _inputs_file(layer, start):
    return f"inputs-{layer:05d}-{start:07d}.safetensors"


class LayerCheckpoint:
    """Checkpoints of one quantization run. Every rank holds one; rank 0 owns state.json and the layer
    files, each rank writes its own share of the next layer's inputs."""

    def __init__(self, out, fingerprint: dict, ranks, nwindows=0):
        self.dir = checkpoint_dir(out)
        self.fingerprint = json.loads(json.dumps(fingerprint))  # as it reads back from JSON
        self.ranks = ranks
        self.nwindows = nwindows
        self.state = None
        self.resumed_from = 0

    @property
    def layers_done(self) -> int:
        return 0 if self.state is None else self.state["layers_done"]

    # --- start ------------------------------------------------------------------------------

    def prepare(self, resume: bool, overwrite: bool):
        """Check or create the directory (rank 0), then load the committed state on every rank."""

        def on_main():
            state = None
            if self.dir.exists():
                if resume and (self.dir / STATE).is_file():
                    state = self._read_state()
                elif not resume and not overwrite:
                    done = self._peek_layers_done()
                    raise CheckpointError(f"{self.dir} holds an interrupted run ({done} layers done); pass --resume to "
                                        "continue it or --overwrite to start over")
            if state is not None:
                self._check_fingerprint(state)
                self._remove_unreferenced(state)
            else:  # nothing committed (or starting over): begin with an empty directory
                shutil.rmtree(self.dir, ignore_errors=True)
            try:
                self.dir.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise StorageError(f"could not create the checkpoint directory {self.dir}: "
                                   f"{exc.strerror or exc}") from exc
            return state

        self.state = self.ranks.run_on_main(on_main)
        self.resumed_from = self.layers_done

    def _peek_layers_done(self):
        try:
            return json.loads((self.dir / STATE).read_text())["layers_done"]
        except (OSError, ValueError, KeyError, TypeError):
            return 0

    def _read_state(self):
        path = self.dir / STATE
        try:
            state = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"{path}: unreadable checkpoint state ({exc}); "
                                  f"remove {self.dir} or pass --overwrite") from exc
        if not isinstance(state, dict) or state.get("format") != FORMAT or state.get("version") != VERSION:
            raise CheckpointError(f"{path} is not a quantkit checkpoint of version {VERSION}; "
                                  f"remove {self.dir} or pass --overwrite")
        return state

    def _check_fingerprint(self, state):
        old = state.get("fingerprint") or {}
        differ = sorted(k for k in set(old) | set(self.fingerprint) if old.get(k) != self.fingerprint.get(k))
        if differ:
            shown = "; ".join(f"{k}: {old.get(k)!r} then, {self.fingerprint.get(k)!r} now" for k in differ[:3])
            raise CheckpointError(f"cannot resume from {self.dir}: it was made with other settings ({shown}); "
                                  "rerun with the same settings, or pass --overwrite instead of --resume to start over")

    def _remove_unreferenced(self, state):
        """Files of a layer that was written but never committed (the run died before state.json)."""
        keep = {STATE} | {f["file"] for f in state["layers"]} | {f["file"] for f in state["inputs"]}
        for path in self.dir.iterdir():
            if path.name not in keep:
                path.unlink() if path.is_file() else shutil.rmtree(path, ignore_errors=True)

    # --- resume -----------------------------------------------------------------------------

    def committed_layers(self):
        """[(layer index, file, {module: meta}, [log entries])] of the committed layers, files verified."""
        out = []
        for item in (self.state or {}).get("layers", []):
            path = self.dir / item["file"]
            if not path.is_file() or file_digest(path) != item["sha256"]:
                raise CheckpointError(f"{path}: checkpoint file missing or altered; pass --overwrite to start over")
            with safe_open(str(path), framework="pt") as fh:
                meta = fh.metadata()
            out.append((item["index"], path, json.loads(meta["modules"]), json.loads(meta["entries"])))
        return out

    def restore(self):
        """({module: QuantizedTensor}, [log entries]) of the committed layers, files verified."""
        from quantkit.formats.base import quantized_tensor_from_state_dict

        qtensors, entries = {}, []
        for _, path, modules, layer_entries in self.committed_layers():
            with safe_open(str(path), framework="pt") as fh:
                tensors = {key: fh.get_tensor(key) for key in fh.keys()}
            own = {name: {} for name in modules}
            for key, value in tensors.items():
                module, _, short = key.rpartition(".")
                own[module][short] = value
            for name, module_meta in modules.items():
                qtensors[name] = quantized_tensor_from_state_dict(module_meta, own[name])
            entries += layer_entries
        return qtensors, entries

    def layer_path(self, index) -> Path:
        """The file of layer `index`'s quantized tensors (written by commit, on rank 0)."""
        return self.dir / _layer_file(index)

    def load_inputs(self, start, stop):
        """The next layer's inputs of windows [start, stop), from whichever rank files hold them (so a
        run may resume with another number of ranks)."""
        pieces = []
        for item in sorted(self.state["inputs"], key=lambda f: f["start"]):
            lo, hi = max(start, item["start"]), min(stop, item["stop"])
            if lo >= hi:
                continue
            path = self.dir / item["file"]
            try:
                with safe_open(str(path), framework="pt") as fh:
                    pieces.append(fh.get_slice("inputs")[lo - item["start"] : hi - item["start"]])
            except Exception as exc:  # missing or damaged: the state is unusable
                raise CheckpointError(f"{path}: unreadable checkpoint activations ({exc}); "
                                      "pass --overwrite to start over") from exc
        got = sum(p.shape[0] for p in pieces)
        if got != stop - start:
            raise CheckpointError(f"{self.dir}: checkpoint holds {got} of the {stop - start} activation windows "
                                  "needed; pass --overwrite to start over")
        return torch.cat(pieces)

    # --- commit -----------------------------------------------------------------------------

    def commit(self, index, layer_qtensors: dict, layer_entries: list, next_inputs=None, window_start=0):
        """Record layer `index` done (every rank calls it). next_inputs: this rank's inputs of layer
        index+1 (None after the last layer, or without calibration)."""
        ranks = self.ranks
        error = None
        try:
            if ranks.is_main:
                self._write_layer(index, layer_qtensors, layer_entries)
            if next_inputs is not None:
                self._write_inputs(index + 1, next_inputs, window_start)
        except (OSError, SafetensorError) as exc:  # safetensors reports I/O failures as its own type
            error = exc
        if not ranks.all_ok(error is None):
            if error is None:
                reason = "another rank could not write its activations"
            else:
                reason = error.strerror if isinstance(error, OSError) and error.strerror else str(error)
            raise StorageError(f"could not write the checkpoint of layer {index} to {self.dir}: {reason}") from error
        previous = list(self.state["inputs"]) if self.state else []

        def on_main():
            layers = [f for f in (self.state["layers"] if self.state else []) if f["file"] != _layer_file(index)]
            path = self.dir / _layer_file(index)
            layers.append({"index": index, "file": path.name, "sha256": file_digest(path)})
            inputs = []
            if next_inputs is not None:
                for r in range(ranks.world_size):
                    lo, hi = ranks.window_range(self.nwindows, r)
                    inputs.append({"file": _inputs_file(index + 1, lo), "start": lo, "stop": hi})
            state = {"format": FORMAT, "version": VERSION, "fingerprint": self.fingerprint, "layers_done": index + 1,
                     "layers": layers, "inputs": inputs}
            try:
                self._atomic_write_text(self.dir / STATE, json.dumps(state, indent=1))
            except OSError as exc:
                raise StorageError(f"could not write {self.dir / STATE}: {exc.strerror or exc}") from exc
            return state

        self.state = ranks.run_on_main(on_main)
        # every rank has read its inputs long before (commit is collective), so the inputs of the
        # layer just done can go
        if ranks.is_main:
            current = {f["file"] for f in self.state["inputs"]}
            for item in previous:
                if item["file"] not in current:
                    (self.dir / item["file"]).unlink(missing_ok=True)

    def _write_layer(self, index, layer_qtensors, layer_entries):
        tensors, modules = {}, {}
        for name, qt in layer_qtensors.items():
            modules[name] = qt.meta()
            for key, value in qt.state_dict().items():
                tensors[f"{name}.{key}"] = value.detach().to("cpu").contiguous()
        metadata = {"modules": json.dumps(modules), "entries": json.dumps(layer_entries)}
        self._atomic_save(tensors, self.dir / _layer_file(index), metadata)

    def _write_inputs(self, layer, inputs, start):
        # one window at a time: the activations (2 GiB for 128 x 2048 x 4096 bf16, often on the GPU) never
        # reach host memory whole
        metadata = {"start": str(start), "stop": str(start + inputs.shape[0])}
        entries = {"inputs": TensorBytes.by_rows(inputs)}
        self._atomic(lambda tmp: write_tensor_file(tmp, entries, metadata), self.dir / _inputs_file(layer, start))

    def _atomic_save(self, tensors, path: Path, metadata):
        self._atomic(lambda tmp: save_file(tensors, str(tmp), metadata=metadata), path)

    @staticmethod
    def _atomic(write, path: Path):
        """write(temporary path), then rename it to `path`; nothing is left under either name on failure."""
        tmp = path.with_name(path.name + ".tmp")
        try:
            write(tmp)
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    @staticmethod
    def _atomic_write_text(path: Path, text: str):
        tmp = path.with_name(path.name + ".tmp")
        try:
            tmp.write_text(text)
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    # --- end --------------------------------------------------------------------------------

    def remove(self):
        """Delete the directory (rank 0; the others wait so nobody reads a vanishing file)."""
        self.ranks.barrier()
        if self.ranks.is_main:
            shutil.rmtree(self.dir, ignore_errors=True)
