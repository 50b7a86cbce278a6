"""Import stub for torchvision: the index's build is CUDA-only and fails to import beside CPU torch.

SGLang imports it at module load for multimodal preprocessing, which the HiCache paths
tested here never run; any attribute is a placeholder that fails if actually used.
"""
import enum
import sys
import types

__version__ = "0.0.0+kvstore-stub"


class InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BOX = "box"
    HAMMING = "hamming"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    LANCZOS = "lanczos"


class _Stub(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)

        def unavailable(*_a, **_k):
            raise RuntimeError(f"torchvision stub: {self.__name__}.{name} is not available in this environment")
        return type(name, (), {"__init__": unavailable, "__call__": unavailable})


for _name in ("transforms", "transforms.functional", "transforms.v2", "transforms.v2.functional", "io", "ops",
              "models", "utils", "datasets"):
    _mod = _Stub(f"{__name__}.{_name}")
    _mod.InterpolationMode = InterpolationMode
    _mod.__path__ = []
    sys.modules[_mod.__name__] = _mod
    _parent, _, _leaf = _mod.__name__.rpartition(".")
    setattr(sys.modules[_parent], _leaf, _mod)
