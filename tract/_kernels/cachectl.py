"""Cache control inside kernels: the native region's instructions, bound
as external functions of jitted code (``cdef api`` in `tract._native._region`,
registered with LLVM by name, so kernels that call them still cache).

A kernel gets the mapping's address and the instruction codes from its
caller (`tract.index`), which holds the mapping open and has checked that
every offset the kernel computes lies inside it; these functions check
nothing.
"""

import llvmlite.binding as llvm
import numba
from numba import types
from numba.extending import get_cython_function_address, intrinsic

from tract._kernels.config import kernel

__all__ = ["add_u32", "fence", "halves", "lines", "words"]

_MODULE = "tract._native._region"
for _name in ("tract_api_lines", "tract_api_fence", "tract_api_add_u32"):
    llvm.add_symbol(_name, get_cython_function_address(_MODULE, _name))

#: ``lines(insn, address, length)``: apply instruction ``insn`` to every line of the range
lines = types.ExternalFunction("tract_api_lines",
                               types.void(types.int32, types.uint64, types.int64))
#: ``fence()``: full fence
fence = types.ExternalFunction("tract_api_fence", types.void())
#: ``add_u32(address, delta)``: host-local atomic add kept in 0..2**32-1; the value found
add_u32 = types.ExternalFunction("tract_api_add_u32",
                                 types.uint32(types.uint64, types.int64))


def _pointer_to(dtype):
    @intrinsic
    def pointer(typingctx, address):
        signature = types.CPointer(dtype)(types.uint64)

        def codegen(context, builder, sig, args):
            return builder.inttoptr(args[0], context.get_value_type(sig.return_type))

        return signature, codegen

    return pointer


_u64, _u32 = _pointer_to(types.uint64), _pointer_to(types.uint32)


@kernel(inline="always")
def words(address, count):
    """The ``count`` u64 words at ``address``, as an array (no copy)."""
    return numba.carray(_u64(address), count)


@kernel(inline="always")
def halves(address, count):
    """The ``count`` u32 words at ``address``, as an array (no copy)."""
    return numba.carray(_u32(address), count)
