"""Bridges to other libraries' loaders; importing this package stays cheap (no torch, no transformers)."""

import sys

_REGISTRY_MODULE = "transformers.quantizers.auto"


def _register():
    from quantkit.integrations.transformers import register

    register()


class _RegisterAfterImport:
    """A meta-path finder that registers quantkit right after transformers' quantizer registry is
    imported, so that `import quantkit` costs nothing until transformers is used."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != _REGISTRY_MODULE:
            return None
        from importlib.machinery import PathFinder

        spec = PathFinder.find_spec(fullname, path)  # the parent package is imported: no recursion
        if spec is None or spec.loader is None:
            return None
        exec_module = spec.loader.exec_module

        def exec_then_register(module):
            exec_module(module)
            sys.modules[fullname] = module
            _register()

        spec.loader.exec_module = exec_then_register
        return spec


def register_with_transformers():
    """Register now if transformers' registry is loaded, else as soon as it is."""
    if _REGISTRY_MODULE in sys.modules:
        _register()
    elif not any(isinstance(finder, _RegisterAfterImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _RegisterAfterImport())
