"""Device tier inside one replica: which adapter sits in which of the `max_loras` slots.

Pure bookkeeping: the weights live in the model's LoRA layers, and the engine copies an adapter in
when `acquire` reports that its slot must be (re)loaded. A slot in use by a running request is
pinned and never evicted; among unpinned slots the least recently used one is reused.
"""

from __future__ import annotations

from collections import OrderedDict, defaultdict
from dataclasses import dataclass


@dataclass
class SlotGrant:
    slot: int
    needs_load: bool  # the slot held another adapter (or none): copy this adapter's weights in first


class AdapterSlots:
    def __init__(self, max_loras: int):
        self.max_loras = max_loras
        self.slot_of: OrderedDict[str, int] = OrderedDict()  # resident adapters, least recently used first
        self.pins = [0] * max_loras
        self.acquisitions = 0  # requests given a slot
        self.loads = 0  # of those, the ones whose adapter had to be copied in
        self.evictions = 0
        self.load_counts: defaultdict[str, int] = defaultdict(int)  # per adapter: copies into a slot

    def resident(self) -> list[str]:
        return list(self.slot_of)

    def acquire(self, adapter_id: str) -> SlotGrant | None:
        """Pin a slot for one more request of `adapter_id`; None if every slot is pinned by other adapters."""
        if adapter_id in self.slot_of:
            slot = self.slot_of[adapter_id]
            self.slot_of.move_to_end(adapter_id)
            self.pins[slot] += 1
            self.acquisitions += 1
            return SlotGrant(slot, needs_load=False)
        slot = self._free_or_evictable_slot()
        if slot is None:
            return None
        self.acquisitions += 1
        self.slot_of[adapter_id] = slot
        self.pins[slot] = 1
        self.loads += 1
        self.load_counts[adapter_id] += 1
        return SlotGrant(slot, needs_load=True)

    def release(self, adapter_id: str) -> None:
        slot = self.slot_of[adapter_id]
        if self.pins[slot] <= 0:
            raise RuntimeError(f"adapter {adapter_id!r} released more often than acquired")
        self.pins[slot] -= 1

    def evict(self, adapter_id: str) -> bool:
        """Free the slot of `adapter_id` unless a running request pins it; whether it was freed."""
        slot = self.slot_of.get(adapter_id)
        if slot is None or self.pins[slot]:
            return False
        del self.slot_of[adapter_id]
        self.evictions += 1
        return True

    def _free_or_evictable_slot(self) -> int | None:
        used = set(self.slot_of.values())
        for slot in range(self.max_loras):
            if slot not in used:
                return slot
        for adapter_id, slot in self.slot_of.items():  # oldest first
            if self.pins[slot] == 0:
                del self.slot_of[adapter_id]
                self.evictions += 1
                return slot
        return None
