"""Building and loading the C++ kernels: compiled once per machine, cached, loaded with ctypes.

The sources (invariant.cpp, quantized.cpp, limbs.cpp, layer.cpp, route.cpp and deltanet.cpp,
with simd.h) are compiled into one library with the system's C++ compiler (`CXX`, else c++, g++
or clang++) for the CPU it runs on (-march=native) and OpenMP, into the cache
(`PROBSERVE_CACHE_DIR`, default ~/.cache/probserve) under a key of the sources, the compiler,
the flags and the CPU's feature list, so a source change, another compiler or another machine
builds afresh and every later start loads the cached library in milliseconds. The build writes
to a temporary file and renames it into place, so concurrent starts never load half a library.
torch is imported first: the library then shares torch's OpenMP runtime (one thread pool, not
two). `python -m probserve.kernels.build` builds it ahead of time (the Makefile's set-up does).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch  # noqa: F401  (loads torch's OpenMP runtime before ours binds to one)

from probserve.cache_dir import cache_root
from probserve.progress import Stage

log = logging.getLogger(__name__)

HERE = Path(__file__).parent
SOURCES = (
    HERE / "invariant.cpp",
    HERE / "quantized.cpp",
    HERE / "limbs.cpp",
    HERE / "layer.cpp",
    HERE / "route.cpp",
    HERE / "deltanet.cpp",
)  # one library
HEADERS = (
    HERE / "simd.h",
    HERE / "probserve.h",
    HERE / "limbs_avx2.h",
    HERE / "limbs_amx.h",
    HERE / "limbs_super.h",
    HERE / "tiles.h",
    HERE / "avx512_emulated.h",
)
# -ffp-contract=off: no multiply-add the source does not write as one (results must not depend
# on what the compiler fuses)
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC", "-std=c++17")
# PROBSERVE_KERNEL_ISA=avx2: the AVX2 + FMA + F16C path even on an AVX-512 machine (tests run
# both paths where the machine has both); unset or "native": the widest the CPU has;
# "avx512-emulated": the native build, but its integer limbs the AVX-512 VNNI path (and its AMX
# kernels) with every AVX-512 intrinsic from SIMDe's exact emulation (avx512_emulated.h): slow,
# for tests of that code on a CPU without AVX-512 (it needs SIMDe's headers: `make simde`)
ISA_ENV = "PROBSERVE_KERNEL_ISA"
SIMDE_FLAG = "-DPS_LIMBS_SIMDE"
ISA_FLAGS = {"native": (), "avx2": ("-mno-avx512f",), "avx512-emulated": (SIMDE_FLAG,)}
SIMDE_HEADER = "simde/x86/avx512.h"
# PROBSERVE_LIMB_TILES: where batches of many rows take the integer limbs (limbs.cpp reads it
# once a process): "auto" (unset) AMX where the CPU has it, "off" never, "emulate" AMX's exact
# emulation (tiles.h: the AMX kernels' code on any CPU with the AVX-512 limb path, native or
# PROBSERVE_KERNEL_ISA=avx512-emulated's; slow, for tests)
TILES_ENV = "PROBSERVE_LIMB_TILES"
TILES = ("auto", "off", "emulate")


def flags() -> tuple[str, ...]:
    """The compiler's flags, with the ISA path PROBSERVE_KERNEL_ISA asks for (part of the
    library's cache key: each path is built once, beside the other)."""
    isa = os.environ.get(ISA_ENV) or "native"
    if isa not in ISA_FLAGS:
        raise KernelBuildError(f"{ISA_ENV}={isa!r}: expected one of {', '.join(ISA_FLAGS)}")
    return (*FLAGS, *ISA_FLAGS[isa])


def simde_version() -> str | None:
    """SIMDe's version line where the compiler's include path has its headers (the emulated
    build's cache key holds it), else None."""
    roots = [*os.environ.get("CPATH", "").split(":"), "/usr/local/include", "/usr/include"]
    for root in filter(None, roots):
        common = Path(root) / "simde" / "simde-common.h"
        if (Path(root) / SIMDE_HEADER).is_file() and common.is_file():
            found = re.search(r"#define\s+SIMDE_VERSION\s+(.+)", common.read_text())
            return found.group(1).strip() if found else str(common)
    return None


HEADER = HERE / "probserve.h"  # every exported prototype and struct, declared once
_CTYPES: dict[str, type | None] = {
    "void": None,
    "int": ctypes.c_int,
    "int64_t": ctypes.c_int64,
    "float": ctypes.c_float,
}


def _ctype(decl: str) -> type | None:
    """A C declaration's type as ctypes has it: a pointer (any) is c_void_p."""
    if "*" in decl:
        return ctypes.c_void_p
    words = [w for w in decl.replace("const", " ").split() if w]
    return _CTYPES[words[0]]


def header_signatures(text: str | None = None) -> dict[str, tuple[type | None, list[type | None]]]:
    """The exported functions of probserve.h: name -> (result, argument types), for ctypes."""
    text = HEADER.read_text() if text is None else text
    text = re.sub(r"//[^\n]*", "", text)
    out: dict[str, tuple[type | None, list[type | None]]] = {}
    for result, name, params in re.findall(r"([\w\s\*]+?)\s*\b(ps_\w+)\s*\(([^)]*)\)\s*;", text):
        args = [p.rsplit(None, 1)[0] if " " in p.strip() else p for p in params.split(",")]
        argtypes = [_ctype(a) for a in args if a.strip()]
        out[name] = (_ctype(result.strip().split("\n")[-1]), argtypes)
    return out


def header_constant(name: str) -> int:
    """A `#define NAME value` of probserve.h (PS_MAX_PARTS)."""
    found = re.search(rf"#define\s+{name}\s+(\d+)", HEADER.read_text())
    if found is None:
        raise KernelBuildError(f"probserve.h defines no {name}")
    return int(found.group(1))


class KernelBuildError(RuntimeError):
    """The kernels cannot be built or loaded here (no compiler, an unsupported CPU)."""


def compiler() -> str:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return name
    raise KernelBuildError(
        "--deterministic needs a C++ compiler to build its kernels and none was found "
        "(set CXX, or install one: Debian/Ubuntu `apt install g++`)"
    )


def _cpu_features() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def library_path(cxx: str) -> Path:
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256(
        b"|".join(
            s.encode()
            for s in (
                *(f.read_text() for f in (*SOURCES, *HEADERS)),
                version,
                " ".join(flags()),
                _cpu_features(),
                (simde_version() or "") if SIMDE_FLAG in flags() else "",
            )
        )
    ).hexdigest()
    return cache_root() / "kernels" / f"invariant-{key[:16]}.so"


# the instruction sets simd.h needs (AVX-512 F alone also does, where these are all there)
NEEDED = ("avx2", "fma", "f16c")


def unsupported_host() -> str | None:
    """Why the kernels cannot build on this machine (one line), or None where they can: they
    are x86-64 Linux code (AVX2, FMA and F16C, or AVX-512)."""
    if not sys.platform.startswith("linux"):
        return f"probserve's C++ kernels build on x86-64 Linux only (this is {platform.system()})"
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"probserve's C++ kernels need an x86-64 CPU (this is {platform.machine()})"
    flags = set(_cpu_features().split())
    missing = [f for f in NEEDED if f not in flags]
    if missing and "avx512f" not in flags:
        return (
            "probserve's C++ kernels need a CPU with AVX2, FMA and F16C, or AVX-512 (this one "
            f"lacks {', '.join(m.upper() for m in missing)})"
        )
    return None


def build() -> Path:
    """The compiled library's path, building it if this machine has none cached."""
    why = unsupported_host()
    if why is not None:
        raise KernelBuildError(why)
    if SIMDE_FLAG in flags() and simde_version() is None:
        raise KernelBuildError(
            f"{ISA_ENV}=avx512-emulated needs SIMDe's headers ({SIMDE_HEADER}) and none were "
            "found (`make simde`; Debian/Ubuntu `apt install libsimde-dev`)"
        )
    cxx = compiler()
    path = library_path(cxx)
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
    os.close(fd)
    what = f"building the C++ kernels for this CPU with {Path(cxx).name}"
    try:
        with Stage(log, what, once=f"kept in {path.parent} for this CPU and compiler"):
            done = subprocess.run(
                [cxx, *flags(), "-o", tmp, *map(str, SOURCES)],
                capture_output=True,
                text=True,
                timeout=300,
            )
        if done.returncode != 0:
            names = ", ".join(f.name for f in SOURCES)
            raise KernelBuildError(f"building {names} with {cxx} failed:\n{done.stderr}")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def isa_path(lib: ctypes.CDLL, limbs: bool = False) -> str:
    """The instruction path a loaded library runs, as it says itself (not as asked):
    "avx512-vnni" (AVX-512 float kernels, integer limbs on VNNI), "avx512" (AVX-512, limbs on
    AVX2) or "avx2" (AVX2 + FMA + F16C throughout, as PROBSERVE_KERNEL_ISA=avx2 forces);
    "avx2+avx512-vnni-emulated" (or "avx512+...") where PROBSERVE_KERNEL_ISA=avx512-emulated
    built the limbs' AVX-512 VNNI path on SIMDe's emulation, on a CPU without it. With
    `limbs` (products in integer limbs), "+amx" where batches of many rows take them to AMX
    tiles, "+amx-emulated" to the tiles' emulation (PROBSERVE_LIMB_TILES=emulate)."""
    narrow = int(lib.ps_lanes()) == 8
    if int(lib.ps_limbs_emulated()):
        base = ("avx2" if narrow else "avx512") + "+avx512-vnni-emulated"
    elif narrow:
        return "avx2"
    else:
        base = "avx512-vnni" if int(lib.ps_limbs_isa()) == 512 else "avx512"
    tiles = int(lib.ps_limb_tiles()) if limbs else 0
    return base + {0: "", 1: "+amx", 2: "+amx-emulated"}[tiles]


def load() -> ctypes.CDLL:
    """The kernels library with its functions' argument types declared."""
    tiles = os.environ.get(TILES_ENV) or "auto"
    if tiles not in TILES:
        raise KernelBuildError(f"{TILES_ENV}={tiles!r}: expected one of {', '.join(TILES)}")
    lib = ctypes.CDLL(str(build()))
    for name, (restype, argtypes) in header_signatures().items():
        fn = getattr(lib, name)
        fn.restype = restype
        fn.argtypes = argtypes
    return lib


if __name__ == "__main__":
    try:
        print(f"probserve kernels: {build()} ({isa_path(load())})")
    except KernelBuildError as exc:
        print(f"probserve kernels not built: {exc}", file=sys.stderr)
        sys.exit(1)
