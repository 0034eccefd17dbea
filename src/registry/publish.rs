//! Publishing roles, placements and open leases into the shared thread table `ps` reads.

use super::{Registry, Slot};
use crate::threadtable;

impl Registry {
    /// Starts publishing roles, placements and the open leases into `table`, one record per
    /// slot; those known now are published at once.
    pub fn publish_into(&mut self, table: Option<&'static threadtable::Mapped>) {
        self.published = table;
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
            })
            .collect();
        table.write_leases(&open);
    }

    pub(super) fn publish(&self, slot: Slot) {
        let Some(table) = self.published else {
            return;
        };
        let value = match self.entry(slot) {
            Some(e) => threadtable::encode(e.tid, e.role, e.placement),
            None => 0,
        };
        table.store_record(slot as usize, value);
    }

    fn publish_all(&self) {
        if self.published.is_some() {
            for slot in 0..self.slots.len() as Slot {
                self.publish(slot);
            }
        }
    }
}
