"""Triton's interpreter without its repeated work on device calls, for the tests' GPU path.

Under TRITON_INTERPRET=1 a kernel launch patches triton.language's builtins to their numpy
versions (`_patch_lang`), runs the grid, and restores them. Every call from a kernel to another
@triton.jit function (a device call: `tile_dot`, `tl.zeros`, ...) runs `_patch_lang` for that
function's globals again: it walks every member of those modules with `inspect.getmembers` and
patches what is not patched yet (the first call of a function defined elsewhere may find a module
the launch did not patch, such as triton.language.core); a second call of the same function in
the same launch finds nothing left to patch and only sets again what was set, the same
behaviour. Those repeats were 56 s of a 182 s test (tests/test_gpu_path.py: 35,030 patches for
1,262 launches, cProfile). Here the first call of each device function in a launch runs Triton's
own call, patch and all; a repeat runs the rewritten function directly, as Triton's call does
after its patch. Where Triton's interpreter no longer has these names nothing is changed, and
the tests run as Triton runs them.
"""

from __future__ import annotations

from typing import Any


def skip_redundant_patches() -> bool:
    """Install the device-call shortcut; False where this Triton has no such interpreter."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
    executor = getattr(interpreter, "GridExecutor", None)
    function = getattr(interpreter, "InterpretedFunction", None)
    error = getattr(interpreter, "InterpreterError", None)
    if executor is None or function is None or error is None:
        return False
    if getattr(function.__call__, "_skips_patches", False):
        return True
    launch, device_call = executor.__call__, function.__call__
    depth = [0]  # launches running (a kernel's grid: the interpreter runs one at a time)
    seen: set[Any] = set()  # the device functions called (and so patched for) in this launch

    def launched(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not depth[0]:
            seen.clear()
        depth[0] += 1
        try:
            return launch(self, *args, **kwargs)
        finally:
            depth[0] -= 1

    def called(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not depth[0] or self.fn not in seen:
            seen.add(self.fn)
            return device_call(self, *args, **kwargs)
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            raise error(repr(exc)) from exc

    called._skips_patches = True  # type: ignore[attr-defined]
    executor.__call__ = launched
    function.__call__ = called
    return True
