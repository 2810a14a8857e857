"""Pages of the paged KV cache and their owner, the PageAllocator.

Every page is one pool block of its layout's ``page_bytes`` (so pages of finished requests are
reused exactly and the pool's figures count the cache page by page). The allocator is the only
owner of page lifetime: it counts the **references** to a page (each RuntimeKVCache that has it
in a block table, whether a request's or a prefix handle's) and, of those, the **holders**
(prefix handles that keep it across calls). A page is tagged ``prefix_cache`` while at least
one holder keeps it and ``kv_cache`` otherwise (``MemoryPool.retag``), so the pool counts a
shared page once, under the tag of what keeps it alive longest; it goes back to the pool when
its last reference goes.
"""

from __future__ import annotations

import collections
import contextlib
import gc

import numpy as np

from ..errors import ConfigError, HandleError
from ..memory import packed_scope
from ..memory.block import contiguous_runs
from .layouts import PageLayout

REQUEST_TAG = "kv_cache"        # a page no prefix handle holds
HELD_TAG = "prefix_cache"       # a page at least one prefix handle holds


class Page:
    """One page: a pool block of ``layout.page_bytes``, its reference and holder counts.

    ``addr`` is the device (or host) address the block tables hold; ``parts`` are typed views
    of the page's parts (see PageLayout). ``refs`` counts the caches that reference it;
    ``holds`` (<= refs) the prefix handles among them. Both change only through the
    PageAllocator.
    """

    __slots__ = ("block", "addr", "layout", "refs", "holds", "_u8", "_parts")

    def __init__(self, block, layout: PageLayout, u8=None):
        self.block = block
        self.addr = block.ptr
        self.layout = layout
        self.refs = 1
        self.holds = 0
        self._u8 = u8             # the page's bytes as uint8, or None: viewed on first use
        self._parts = None

    @property
    def parts(self) -> dict:
        """Typed views of the page's parts, made on first use (the CUDA kernels read pages by
        address and never need them; the NumPy reference and the tests do)."""
        if self._parts is None:
            if self.refs <= 0:
                raise HandleError("page was released")
            if self._u8 is None:
                self._u8 = self.block.array((self.layout.page_bytes,), np.uint8)
            self._parts = self.layout.views(self._u8)
        return self._parts

    def drop_views(self) -> None:
        """Forget the views into the page's bytes (its block is about to go back)."""
        self._u8 = self._parts = None


@contextlib.contextmanager
def gc_paused():
    """Hold off Python's cyclic garbage collector inside the block (restored after, unless it
    was off already). A batch of pages makes 4 tracked objects per page (chunk, block, page,
    event), enough for several young-generation collections and now and then a full one over
    every live object of the process before a long prefill's first kernel. Paused, the
    collection runs after the batch, while the device works (docs/kv_modes.md "Page size"
    has the measurement)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


class PageAllocator:
    """Hands out pages as pool blocks (one block per page, tag ``kv_cache`` unless given),
    zeroed at allocation, and counts their references and holders. One per Model (pages may
    outlive the request that wrote them when shared). ``page(addr)`` maps a block-table entry
    back to its Page (how the NumPy reference reads through the block table)."""

    def __init__(self, ops, pool):
        self._ops = ops
        self._pool = pool
        self._pages: dict[int, Page] = {}       # addr -> live Page

    def alloc(self, layout: PageLayout, tag: str = REQUEST_TAG) -> Page:
        """A fresh zeroed page (refs = 1); raises the pool's OutOfMemoryError.

        The one-page path (one pool allocation, one view, one memset)."""
        with packed_scope():                    # pages share segments with the model's
            u8, blk = self._ops.empty(self._pool, (layout.page_bytes,), np.uint8, tag)
        try:
            self._ops.zero(u8)
            page = Page(blk, layout, u8)
        except BaseException:
            self._pool.free(blk)
            raise
        self._pages[page.addr] = page
        return page

    def alloc_many(self, layout: PageLayout, n: int, tag: str = REQUEST_TAG) -> list[Page]:
        """``n`` fresh zeroed pages (refs = 1 each), all or nothing: the pages ``n`` calls of
        :meth:`alloc` would return (same addresses in the same order, one pool block and one
        ``alloc`` event each), from one ``MemoryPool.allocate_many`` and one memset per
        address-contiguous run (``Ops.zero_ranges``). Views are made on first use of
        ``Page.parts``. Raises the pool's OutOfMemoryError with nothing allocated."""
        with packed_scope(), gc_paused():
            blocks = self._pool.allocate_many(layout.page_bytes, n, tag)
            try:
                self._ops.zero_ranges(contiguous_runs(blocks))
            except BaseException:
                self._pool.free_many(blocks)
                raise
            pages = [Page(b, layout) for b in blocks]
            self._pages.update((p.addr, p) for p in pages)
        return pages

    def ref(self, page: Page) -> Page:
        """One more reference to a live ``page``; returns it. Raises HandleError for a
        released page."""
        if page.refs <= 0:
            raise HandleError("page was already released")
        page.refs += 1
        return page

    def unref(self, page: Page) -> None:
        """Drop one reference; the last frees the page's block. Raises HandleError for a page
        released twice or one whose references would fall below its holders."""
        self.unref_many([page])

    def unref_many(self, pages) -> None:
        """:meth:`unref` of every page in ``pages`` (a page may appear more than once, one
        reference each), the pages reaching 0 freed under one pool lock hold. Raises
        HandleError, before changing anything, when a page would be released twice or keep
        more holders than references."""
        pages = list(pages)
        drops = collections.Counter(map(id, pages))    # a page listed k times drops k
        for p in pages:
            d = drops[id(p)]
            if d > p.refs:
                raise HandleError("page released twice")
            if p.refs - d < p.holds:
                raise HandleError("a held page lost the reference of its holder")
        dead = []
        live = self._pages
        for p in pages:
            p.refs -= 1
            if p.refs == 0:
                del live[p.addr]
                p.drop_views()
                dead.append(p.block)
        self._pool.free_many(dead)

    def hold(self, page: Page) -> None:
        """A prefix handle that references ``page`` keeps it across calls: the first holder
        moves it to tag ``prefix_cache``. Raises HandleError for a page with no reference
        left for the new holder."""
        if page.holds >= page.refs:
            raise HandleError("a page needs a reference for each of its holders")
        if page.holds == 0:
            self._pool.retag(page.block, HELD_TAG)
        page.holds += 1

    def drop(self, page: Page) -> None:
        """A holder lets go of ``page`` (its reference stays until the cache drops it): with
        no holder left the page is a request's page again (tag ``kv_cache``). Raises
        HandleError for a page no holder keeps."""
        if page.holds <= 0:
            raise HandleError("page dropped by a holder it does not have")
        page.holds -= 1
        if page.holds == 0:
            self._pool.retag(page.block, REQUEST_TAG)

    def page(self, addr: int) -> Page:
        """The live Page at block-table entry ``addr``; raises HandleError for any other."""
        try:
            return self._pages[int(addr)]
        except KeyError:
            raise HandleError(f"block table entry {int(addr):#x} is not a live page") from None

    @property
    def live_pages(self) -> int:
        return len(self._pages)

    @property
    def held_pages(self) -> int:
        """Live pages at least one prefix handle holds (tag ``prefix_cache``)."""
        return sum(1 for p in self._pages.values() if p.holds)


def copy_page(src: Page, dst: Page) -> None:
    """Copy every byte of page ``src`` into ``dst`` (same layout), on the pages' device.
    Raises ConfigError for pages of two layouts."""
    n = src.layout.page_bytes
    if dst.layout != src.layout:
        raise ConfigError("copy_page needs two pages of one layout")
    dst.block.array((n,), np.uint8)[...] = src.block.array((n,), np.uint8)
