"""The convolution geometry of the adaptive conv kernels, as one named structure.

:class:`ConvGeometry` is a ``NamedTuple`` of ints, so it is also the flat ``int[]`` that the
``sparsa::adaptive_*`` custom ops take (``torch.library`` schemas have no structs); inside an op the
list becomes named again with :meth:`ConvGeometry.of`. :meth:`ConvGeometry.c` is the one place it is
flattened for C: :class:`ConvGeoC`, whose fields mirror ``Geo(const int64_t*)`` in
``csrc/adaptive_geo.h`` field for field.

Example::

    >>> from sparsa.kernels.geometry import ConvGeometry
    >>> g = ConvGeometry.of_conv((2, 8, 5, 5), (16, 8, 3, 3), stride=(1, 1), padding=(1, 1), dilation=(1, 1))
    >>> (g.O, g.Ho, g.Wo, g.stride1)
    (16, 5, 5, True)
"""

from __future__ import annotations

import ctypes
from typing import NamedTuple, Sequence

__all__ = ["ConvGeometry", "ConvGeoC"]


class ConvGeometry(NamedTuple):
    """Input ``[N, C, H, W]``, weight ``[O, C, KH, KW]``, output ``[Ho, Wo]``, stride, padding,
    dilation, and the channel slice of the list operand (``slice`` channels a slice)."""

    N: int
    C: int
    H: int
    W: int
    O: int  # noqa: E741 - the conv's usual name for out_channels
    KH: int
    KW: int
    Ho: int
    Wo: int
    sh: int
    sw: int
    ph: int
    pw: int
    dh: int
    dw: int
    slice: int

    @classmethod
    def of(cls, geo: Sequence[int]) -> "ConvGeometry":
        """The named geometry of a flat ``geo`` (a custom op's ``int[]`` argument)."""
        if isinstance(geo, cls):
            return geo
        if len(geo) != len(cls._fields):
            raise ValueError(
                f"geo must have {len(cls._fields)} ints ({', '.join(cls._fields)}), got {list(geo)}; "
                "build it with ConvGeometry.of_conv"
            )
        return cls(*(int(v) for v in geo))

    @classmethod
    def of_conv(
        cls,
        x_shape: Sequence[int],
        w_shape: Sequence[int],
        stride: Sequence[int],
        padding: Sequence[int],
        dilation: Sequence[int],
        slice: int = 64,
    ) -> "ConvGeometry":
        """The geometry of a conv of an input ``[N, C, H, W]`` with a weight ``[O, C, KH, KW]``."""
        N, C, H, W = (int(v) for v in x_shape)
        O, Cw, KH, KW = (int(v) for v in w_shape)
        if Cw != C:
            raise ValueError(f"weight has {Cw} input channels but the input has {C}; pass matching shapes")
        sh, sw = (int(v) for v in stride)
        ph, pw = (int(v) for v in padding)
        dh, dw = (int(v) for v in dilation)
        Ho = (H + 2 * ph - dh * (KH - 1) - 1) // sh + 1
        Wo = (W + 2 * pw - dw * (KW - 1) - 1) // sw + 1
        return cls(N, C, H, W, O, KH, KW, Ho, Wo, sh, sw, ph, pw, dh, dw, int(slice))

    @property
    def stride1(self) -> bool:
        return self.sh == 1 and self.sw == 1

    def c(self) -> "ConvGeoC":
        """The C structure the kernels read (the only flattening for C)."""
        return ConvGeoC(*self)


class ConvGeoC(ctypes.Structure):
    """``const int64_t* g`` of the adaptive kernels: the layout of ``Geo(const int64_t*)`` in
    ``csrc/adaptive_geo.h`` (16 contiguous int64 fields, in :class:`ConvGeometry`'s order)."""

    _fields_ = [(name, ctypes.c_int64) for name in ConvGeometry._fields]
