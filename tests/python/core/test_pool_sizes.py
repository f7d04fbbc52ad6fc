"""Pool sizes: memory is not reserved per token up front, and sizes that cannot be held raise."""

import pytest

import radixkv

pytestmark = pytest.mark.robust


def test_a_huge_block_pool_reserves_no_token_memory() -> None:
    # 2**20 pages of 65536 tokens: 2**36 token slots, which a per-token array cannot hold.
    c = radixkv.BlockCache(2**20, 65536)
    assert c.metadata_bytes < 2**28
    r = c.admit(list(range(65537)))
    c.commit(r, 65537)
    c.finish(r)
    c.check()
    assert c.stats.evictable_pages == 1


@pytest.mark.parametrize("cls", [radixkv.RadixCache, radixkv.BlockCache])
def test_pool_sizes_out_of_range_name_the_size(cls: type) -> None:
    with pytest.raises(ValueError, match=r"num_pages.*2\*\*31.*2147483648"):
        cls(2**31, 16)
    with pytest.raises(ValueError, match=r"page_size.*65537"):
        cls(4, 65537)
