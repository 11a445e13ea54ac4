"""The packed tensors of a quantization run's finished layers, kept on disk instead of in memory.

A QuantizedStore is the {module name: QuantizedTensor} mapping that quantize_model fills and returns, but
it holds in memory only each module's meta and where its tensors lie. When layer i is finished, its
tensors go to `<spill dir>/layer-0000i.safetensors`, or, when the layer checkpoint is on, stay in the
checkpoint's file of the very same tensors (engine/checkpoint.py), which is not written twice; the
engine then drops them. artifact.write_artifact copies them from those files into the artifact one tensor
at a time; store[name] reads a module back. Host memory for packed tensors is then a few layers', not
the model's (3.4 GB for a 4-bit 7B model).

Spill files are written by one background thread while the engine goes on with the next layer (written in
line, they were most of the 3.8 s a 7B run spent finishing layers); at most WRITES_IN_FLIGHT layers wait for
it, a failed write is raised at the next layer or read, and every read waits for the writes before it.

The spill directory, `.<out name>.spill-<pid>` beside the output, is the store's alone: remove() deletes it
(after the writes in flight) whether the run succeeded or failed, and the next run to the same output deletes
one a killed run left. A store with keep=False (the ranks other than 0 of a torchrun job, which do not write
the artifact) keeps the modules' meta and nothing else.
"""

import glob
import json
import os
import shutil
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from quantkit.artifact import quantized_entries, read_header
from quantkit.errors import StorageError
from quantkit.tensorfile import file_entries, write_tensor_file

WRITES_IN_FLIGHT = 2  # layers' packed tensors held in memory at most while the writer catches up


def spill_dir(out) -> Path:
    out = Path(out)
    return out.parent / f".{out.name}.spill-{os.getpid()}"


def remove_stale_spills(out):
    """Delete the spill directories of earlier runs to `out` whose process is gone (a killed run cannot
    clean up after itself); a directory of a live process is left alone."""
    out = Path(out)
    for path in out.parent.glob(f".{glob.escape(out.name)}.spill-*"):
        pid = path.name.rpartition("-")[2]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
        except OSError:  # alive, another user's
            pass


class QuantizedStore(Mapping):
    """{module name: QuantizedTensor} whose tensors wait in files (see the module docstring)."""

    def __init__(self, directory, keep=True):
        self.directory = Path(directory)
        self.keep = keep
        self._meta = {}  # module -> meta, in the order the layers were finished
        self._tensors = {}  # module -> {short name: TensorBytes (a file range)}
        self._layers = []  # (layer index, [module names])
        self._writer = None  # the thread writing spill files, started with the first
        self._pending = []  # (future of a spill file's path, modules, tensors), in layer order

    # --- filling ------------------------------------------------------------------------------

    def add_layer(self, index, layer_q: dict, path=None):
        """Take layer `index`'s {module: QuantizedTensor}; the caller then drops them. `path`: a safetensors
        file that already holds exactly these tensors (the layer checkpoint's); else they are written to
        the spill directory."""
        modules, tensors = quantized_entries(layer_q)
        self._layers.append((index, list(modules)))
        self._meta.update(modules)
        if not self.keep:
            return
        if path is not None:
            self._index(path, modules, tensors)
            return
        self._settle(keep=WRITES_IN_FLIGHT - 1)  # an earlier layer's failed write is raised here
        if self._writer is None:
            self._writer = ThreadPoolExecutor(1, thread_name_prefix="quantkit-spill")
        self._pending.append((self._writer.submit(self._write, index, tensors, modules), modules, tensors))

    def add_file(self, index, path, modules: dict):
        """Take layer `index` from a file that holds its tensors (a resumed run's checkpoint); `modules`:
        {module: meta} of the layer."""
        self._layers.append((index, list(modules)))
        self._meta.update(modules)
        if self.keep:
            self._index(path, modules)

    def _write(self, index, tensors, modules) -> Path:
        path = self.directory / f"layer-{index:05d}.safetensors"
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            write_tensor_file(path, tensors, {"modules": json.dumps(modules)})
        except OSError as exc:
            raise StorageError(f"could not write the quantized tensors of layer {index} to {self.directory}: "
                               f"{exc.strerror or exc}") from exc
        return path

    def _settle(self, keep=0):
        """Index the spill files written so far, in order, waiting until at most `keep` writes are in flight
        (a write that failed raises its error here)."""
        while self._pending and (len(self._pending) > keep or self._pending[0][0].done()):
            future, modules, tensors = self._pending[0]
            self._index(future.result(), modules, tensors)  # a failed write stays pending: raised again on reads
            self._pending.pop(0)

    def _index(self, path, modules, expected=None):
        found = file_entries(path, read_header(Path(path)))
        if expected is not None:
            got = {name: (e.dtype, e.shape) for name, e in found.items()}
            if got != {name: (e.dtype, e.shape) for name, e in expected.items()}:
                raise RuntimeError(f"{path} does not hold the tensors of its layer")
        own = {name: {} for name in modules}
        for full, entry in found.items():
            module, _, short = full.rpartition(".")
            if module not in own:
                raise RuntimeError(f"{path}: tensor {full} of no module of its layer")
            own[module][short] = entry
        self._tensors.update(own)

    # --- reading ------------------------------------------------------------------------------

    def modules(self) -> dict:
        """{module: meta}, read from memory."""
        return dict(self._meta)

    def stored_tensors(self) -> dict:
        """{"module.short": TensorBytes} of every stored tensor: file ranges, nothing read."""
        self._check_kept()
        self._settle()
        return {f"{name}.{short}": entry for name, own in self._tensors.items() for short, entry in own.items()}

    def __getitem__(self, name):
        from quantkit.formats.base import quantized_tensor_from_state_dict

        if name not in self._meta:
            raise KeyError(name)
        self._check_kept()
        self._settle()
        tensors = {short: entry.load() for short, entry in self._tensors[name].items()}
        return quantized_tensor_from_state_dict(self._meta[name], tensors)

    def __iter__(self):
        return iter(self._meta)

    def __contains__(self, name):  # from memory: Mapping's default would read the module from disk
        return name in self._meta

    def keys(self):
        return self._meta.keys()

    def __len__(self):
        return len(self._meta)

    def _check_kept(self):
        if not self.keep:
            raise RuntimeError("this store keeps no tensors (a rank that does not write the artifact)")

    # --- whole-store steps --------------------------------------------------------------------

    def converted(self, convert) -> "QuantizedStore":
        """A store of convert(name, QuantizedTensor) for every module, converted one layer at a time into a
        subdirectory of this one (so remove() takes it too). A store that keeps no tensors has nothing to
        convert and returns itself."""
        if not self.keep:
            return self
        out = QuantizedStore(self.directory / "converted")
        try:
            for index, names in self._layers:
                out.add_layer(index, {name: convert(name, self[name]) for name in names})
            out._settle()
        finally:
            out._stop_writer()  # this store's remove() takes the directory, not its writer
        return out

    def _stop_writer(self):
        if self._writer is not None:
            self._writer.shutdown(wait=True)
            self._writer = None

    def remove(self):
        self._stop_writer()  # no write may land after the directory is gone
        self._pending = []
        shutil.rmtree(self.directory, ignore_errors=True)
