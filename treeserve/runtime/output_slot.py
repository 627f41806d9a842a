"""A stream's untaken output (the newest, the deltas merged, or the error that ended it) and its wake-up;
a step puts without waiting, and no queue holds outputs the consumer would only skip or merge."""

from __future__ import annotations

import asyncio

from treeserve.outputs import RequestOutput, merged


class OutputSlot:
    __slots__ = ("delta", "item", "waiter")

    def __init__(self, delta: bool) -> None:
        self.delta = delta  # outputs are deltas: merge them, rather than keep the newest
        self.item: RequestOutput | Exception | None = None
        self.waiter: asyncio.Future | None = None

    def put(self, item: RequestOutput | Exception) -> None:
        held = self.item
        if isinstance(held, Exception):
            return
        if held is not None and self.delta and not isinstance(item, Exception):
            item = merged(held, item)
        self.item = item
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def take(self) -> RequestOutput:
        """What was put since the last take (waits for it); raises the error put instead."""
        while self.item is None:
            self.waiter = asyncio.get_running_loop().create_future()
            await self.waiter
        item, self.item, self.waiter = self.item, None, None
        if isinstance(item, Exception):
            raise item
        return item
