"""`TierFetch`: a waiting prompt's pages brought back from the KV tiers before its admission.

A :class:`~radixkv.KVCache` with a disk tier or a shared tier keeps pages outside memory; a prompt
that finds them there is admitted with them as hits only if they are back in memory when the
scheduler ranks it. The :class:`~radixkv.engine.batcher.Batcher` owns this step of a prompt's
way in, at the two points where it matters:

```text
  Batcher.submit(seq)      the disk's pages read back at once; with a shared tier, its fetch
                           started, and the prompt held back from the scheduler while it is out
                           (up to kv.shared.hold_s)
  Batcher.next_batch()     held-back prompts whose fetch came back are queued; the queue's head
                           (up to the step's budget) gets what went to disk while it waited
                           read back again, so that the ranking sees it as host hits
```

A disk that fails to read costs the hit, not the request: its tokens are computed, the failure
is counted (``EngineStats.disk_errors``, one warning). The shared tier never raises for its
store (it counts its failures itself).
"""

from __future__ import annotations

import time
import warnings
from typing import Any

from radixkv.engine.sequence import Sequence


class TierFetch:
    """Brings back ``seq``'s pages from ``kv``'s disk and shared tiers (``__call__``),
    accounting tokens, time and failures in ``stats`` (an ``EngineStats``)."""

    def __init__(self, kv: Any, stats: Any) -> None:
        self.kv, self.stats = kv, stats
        #: Whether a prompt whose fetch is out waits out of the scheduler (a shared tier).
        self.holds_back: bool = kv.shared is not None

    def __call__(self, seq: Sequence) -> bool:
        """Reads back from the disk tier the pages of ``seq`` (waiting, about to be ranked for
        admission) that memory lacks, and installs what the shared tier fetched of them or
        starts that fetch (on its own thread: the step never waits on the store): its
        admission finds them as hits. Returns whether a shared fetch for it is still out."""
        st = self.stats
        t = time.perf_counter()
        out = False
        try:
            disk, shared, out = self.kv.fetch(seq.target, seq.cache_namespace)
            st.disk_tokens += disk
            st.shared_tokens += shared
        except (OSError, RuntimeError) as e:
            # the cache confirmed nothing it did not read: the request computes those tokens
            st.disk_errors += 1
            if st.disk_errors == 1:
                warnings.warn(
                    f"reading the disk tier failed ({e}); requests compute what it held",
                    RuntimeWarning,
                    stacklevel=2,
                )
        st.disk_s += time.perf_counter() - t
        return bool(out)
