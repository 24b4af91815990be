"""The on-disk cache of NVRTC's binaries (quarl.quant.kernels.nvrtc_cache): a kernel compiled
once is loaded from disk by the next process; every input of the binary is in the key; a file
that does not check out, a binary the driver refuses, an unwritable directory and
``QUARL_KERNEL_CACHE=off`` all fall back to compiling. NVRTC and the module loader are stand-ins
here (no GPU); tests_gpu runs the real ones."""

import hashlib

import pytest

from quarl.quant.kernels import nvrtc_cache


class Toolchain:
    """A stand-in NVRTC (its binary is a function of its inputs) and module loader."""

    def __init__(self):
        self.compiled, self.loaded = [], []

    def compile(self, source, name, arch, options):
        self.compiled.append((name, arch, tuple(options)))
        body = hashlib.sha256(repr((source, name, arch, options)).encode()).digest() * 64
        return b"\x7fELF" + body, f"_Z{len(name)}{name}"

    def load(self, binary, mangled):
        self.loaded.append((binary, mangled))
        return ("kernel", mangled, hashlib.sha256(binary).hexdigest())

    def kernel(self, source="src", name="k<1>", arch="90a", options=("-std=c++17",), chain="torch x cuda y nvrtc z"):
        return nvrtc_cache.compile_kernel(source, name, arch, list(options), compile=self.compile, load=self.load,
                                          chain=chain)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(nvrtc_cache.ENV, str(tmp_path / "kernels"))
    return tmp_path / "kernels"


def test_a_kernel_compiled_once_is_loaded_from_disk_afterwards(cache):
    first = Toolchain()
    k1 = first.kernel()
    assert first.compiled == [("k<1>", "90a", ("-std=c++17",))]
    files = list(cache.iterdir())
    assert len(files) == 1 and files[0].suffix == ".cubin"
    later = Toolchain()  # another process: nothing in memory
    assert later.kernel() == k1 and later.compiled == []
    assert later.loaded == first.loaded  # the very bytes and mangled name NVRTC gave
    assert not [p for p in cache.iterdir() if ".tmp" in p.name]


@pytest.mark.parametrize("change", [dict(source="src2"), dict(name="k<2>"), dict(arch="89"),
                                    dict(options=("-std=c++17", "-DW4_TRACE")), dict(chain="torch x cuda y nvrtc z2")])
def test_every_input_of_the_binary_is_in_the_key(cache, change):
    tc = Toolchain()
    a = tc.kernel()
    b = tc.kernel(**change)
    assert len(tc.compiled) == 2 and len(list(cache.iterdir())) == 2
    assert a != b or "chain" in change  # (the stand-in NVRTC does not read the toolchain)
    assert tc.kernel(**change) == b and len(tc.compiled) == 2


@pytest.mark.parametrize("damage", ["truncate", "flip", "garbage", "empty"])
def test_a_file_that_does_not_check_out_is_compiled_again_and_replaced(cache, damage):
    tc = Toolchain()
    want = tc.kernel()
    (path,) = cache.iterdir()
    data = path.read_bytes()
    head, _, binary = data.partition(b"\n")
    path.write_bytes({"truncate": data[:-100], "flip": head + b"\n" + bytes([binary[0] ^ 1]) + binary[1:],
                      "garbage": b"not a cache file", "empty": b""}[damage])
    assert nvrtc_cache.read_entry(path) is None
    again = Toolchain()
    assert again.kernel() == want and len(again.compiled) == 1
    assert nvrtc_cache.read_entry(path) == (binary, "_Z4k<1>")


def test_a_binary_the_driver_refuses_is_compiled_again(cache):
    Toolchain().kernel()
    tc = Toolchain()
    refused = []
    real = tc.load

    def load(binary, mangled):
        if not refused:
            refused.append(binary)
            raise RuntimeError("CUDA error: device kernel image is invalid")
        return real(binary, mangled)

    tc.load = load
    assert tc.kernel()[0] == "kernel" and len(tc.compiled) == 1 and refused


def test_off_keeps_nothing_on_disk(tmp_path, monkeypatch):
    monkeypatch.setenv(nvrtc_cache.ENV, "off")
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert nvrtc_cache.cache_dir() is None
    tc = Toolchain()
    tc.kernel()
    tc.kernel()
    assert len(tc.compiled) == 2 and not list(tmp_path.iterdir())


def test_the_default_directory_follows_xdg_then_home(tmp_path, monkeypatch):
    monkeypatch.delenv(nvrtc_cache.ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert nvrtc_cache.cache_dir() == tmp_path / "xdg" / "quarl" / "kernels"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert nvrtc_cache.cache_dir() == tmp_path / "home" / ".cache" / "quarl" / "kernels"


def test_a_directory_in_the_way_warns_once_and_compiles(tmp_path, monkeypatch):
    """A cache directory that cannot be made or written (here a file stands where it should be:
    root writes read-only directories) warns once and compiles as before."""
    (tmp_path / "kernels").write_text("a file, not a directory")
    monkeypatch.setenv(nvrtc_cache.ENV, str(tmp_path / "kernels"))
    monkeypatch.setattr(nvrtc_cache, "_WARNED", set())
    tc = Toolchain()
    with pytest.warns(RuntimeWarning, match="cannot be kept in") as seen:
        tc.kernel()
        tc.kernel(name="k<2>")
    assert len(seen) == 1 and len(tc.compiled) == 2


def test_the_w4_kernel_builders_ask_for_what_torch_compiled_before(monkeypatch):
    """cuda_w4 compiles through the cache with the source, name, architecture and options it
    gave ``torch.cuda._compile_kernel``; the loaded kernel gets its shared-memory size."""
    from quarl.quant.kernels import cuda_w4

    asked = []

    class Kernel:
        def set_shared_memory_config(self, n):
            self.smem = n

    def fake(source, name, compute_capability=None, nvcc_options=None):
        asked.append((source, name, compute_capability, nvcc_options))
        return Kernel()

    monkeypatch.setattr(nvrtc_cache, "compile_kernel", fake)
    k = cuda_w4._wgmma_kernel.__wrapped__(2, 128, 4, False, 99_000, prescale=1, tma=True, producer=True)
    assert k.smem == 99_000
    source, name, cc, opts = asked[-1]
    assert source == cuda_w4.source("wgmma") and "w4a16_wgmma_tma_ws<2, 128, 4, false, false, 1>" == name
    assert cc == "90a" and opts == ["-std=c++17"]
    cuda_w4._frag_kernel.__wrapped__(2, True, 8)
    assert asked[-1][1:] == ("w4a16_frag<2, true, 8>", None, ["-std=c++17"]) and asked[-1][0] == cuda_w4.source()
