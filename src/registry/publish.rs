//! Publishing roles, placements and open leases into the shared thread table `ps` reads.

use std::sync::atomic::Ordering;

use super::{Registry, Slot};
use crate::mask::CpuMask;
use crate::table::threadtable;

impl Registry {
    /// Starts publishing roles, placements and the open leases into `table`, one record per
    /// slot; those known now are published at once.
    pub fn publish_into(&mut self, table: Option<&'static threadtable::Mapped>) {
        self.published = table;
        self.published_records = table.map_or(&[], |t| t.allocated_records());
        self.publish_all();
        self.publish_leases();
    }

    /// Writes the open leases into the table; under the registry's lock, their one writer.
    pub(super) fn publish_leases(&self) {
        let Some(table) = self.published else {
            return;
        };
        let open: Vec<threadtable::LeaseLine> = self
            .leases
            .iter()
            .map(|l| threadtable::LeaseLine {
                id: l.id,
                gpu_index: l.gpu,
                device: l.device.clone(),
                slice: l.slice.as_deref().and_then(|s| CpuMask::parse_list(s).ok()),
            })
            .collect();
        table.write_leases(&open);
    }

    pub(super) fn publish(&mut self, slot: Slot) {
        let Some(record) = self.published_records.get(slot as usize) else {
            return self.publish_past_allocated(slot);
        };
        let value = match self.entry(slot) {
            Some(e) => threadtable::encode(e.tid, e.role, e.placement),
            None => 0,
        };
        record.store(value, Ordering::Relaxed);
    }

    /// A slot past the records whose pages exist: its page is allocated first (never a store
    /// into a page that may not exist, SPEC §9); one that cannot be is not published.
    #[cold]
    fn publish_past_allocated(&mut self, slot: Slot) {
        let Some(table) = self.published else {
            return;
        };
        if let Some(records) = table.allocate_records_through(slot as usize) {
            self.published_records = records;
            if records.get(slot as usize).is_some() {
                self.publish(slot);
            }
        }
    }

    fn publish_all(&mut self) {
        if self.published.is_some() {
            for slot in 0..self.slots.len() as Slot {
                self.publish(slot);
            }
        }
    }
}
