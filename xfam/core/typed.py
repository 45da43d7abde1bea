"""``TypedModuleList``: an ``nn.ModuleList`` whose items the type checker knows.

``nn.ModuleList`` types its items as ``nn.Module``, whose attributes a checker then sees as ``Tensor | Module``
(``Module.__getattr__``): every use of a block's attention or a layer's memory would need a cast. For the checker
``TypedModuleList[M]`` is a generic subclass yielding ``M``; at run time it is ``nn.ModuleList`` itself, so the
modules built, their parameter names and their repr are exactly what they were.

    self.blocks = TypedModuleList(Block(...) for i in range(n))  # mypy: TypedModuleList[Block]
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Generic, TypeVar, overload

from torch import nn

M = TypeVar("M", bound=nn.Module)

if TYPE_CHECKING:

    class TypedModuleList(nn.ModuleList, Generic[M]):
        def __init__(self, modules: Iterable[M] | None = None) -> None: ...

        def __iter__(self) -> Iterator[M]: ...

        @overload
        def __getitem__(self, idx: slice) -> TypedModuleList[M]: ...

        @overload
        def __getitem__(self, idx: int) -> M: ...

        def __getitem__(self, idx: int | slice) -> M | TypedModuleList[M]: ...

else:
    TypedModuleList = nn.ModuleList
