"""``python -m hvdlite.run`` is ``hvdliterun``.

``hvdlite.run`` is also Horovod's ``horovod.run`` function
(:func:`hvdlite.runner.function.run`). Importing this module would replace that
attribute of the package with the module, so the module is made callable and
forwards to the function: ``hvdlite.run(fn, np=2)`` works either way.
"""
import sys
import types

from hvdlite.runner.function import run as _run_function
from hvdlite.runner.launch import main


class _CallableModule(types.ModuleType):
    def __call__(self, *args, **kwargs):   # type: ignore[no-untyped-def]
        return _run_function(*args, **kwargs)


if __name__ == "__main__":
    sys.exit(main())
else:
    sys.modules[__name__].__class__ = _CallableModule
