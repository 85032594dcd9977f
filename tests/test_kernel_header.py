"""The kernels' interface is declared once (kernels/probserve.h): every .cpp includes it, every
function the library exports is declared there (so ctypes' signatures, read from it, cover
them all), and the structs' sizes agree with their ctypes mirrors (checked at load)."""

from __future__ import annotations

import ctypes
import re

import pytest

from probserve.kernels import build
from probserve.kernels.build import KernelBuildError, header_signatures
from probserve.kernels.native_structs import STRUCTS, check_struct_sizes


def test_every_source_includes_the_header_and_every_export_is_declared() -> None:
    declared = header_signatures()
    for source in build.SOURCES:
        text = source.read_text()
        assert '#include "probserve.h"' in text, source.name
        # a definition at the top level: `type ps_name(...) {`
        defined = set(re.findall(r"^\w[\w\s\*]*?\b(ps_\w+)\s*\([^;{]*\)\s*\{", text, re.M))
        assert defined <= set(declared), (source.name, defined - set(declared))
    assert declared["ps_linear"] == (None, [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                            ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                                            ctypes.c_void_p])  # fmt: skip
    assert declared["ps_qblock_bytes"] == (ctypes.c_int64, [ctypes.c_int])


def test_the_structs_sizes_are_checked_against_their_mirrors() -> None:
    try:
        lib = build.load()
    except KernelBuildError as exc:
        pytest.skip(f"the kernels do not build here: {exc}")
    check_struct_sizes(lib)  # the built library agrees

    class Drifted:  # a library whose PsLayer grew a field the mirror lacks
        @staticmethod
        def ps_struct_sizes(out: ctypes.Array) -> None:
            for i, t in enumerate(STRUCTS):
                out[i] = ctypes.sizeof(t) + (8 if i == 2 else 0)

    with pytest.raises(KernelBuildError, match="structs"):
        check_struct_sizes(Drifted())  # type: ignore[arg-type]
