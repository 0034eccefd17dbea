//! Publishing roles, placements and open leases into the shared thread table `ps` reads.

use std::sync::atomic::{AtomicU64, Ordering};

use super::{Registry, Slot};
use crate::threadtable;

impl Registry {
    /// Starts publishing roles and placements into `table`, one record per slot.
    pub fn publish_into(&mut self, table: Option<&'static [AtomicU64]>) {
        self.published = table;
        if let Some(t) = table {
            for record in t.iter().take(self.slots.len()) {
                record.store(0, Ordering::Relaxed);
            }
        }
        self.publish_all();
    }

    /// Starts publishing the open leases into a table's header and lease words (see
    /// [`threadtable::write_leases`]), and publishes those open now.
    pub fn publish_leases_into(
        &mut self,
        words: Option<(&'static [AtomicU64], &'static [AtomicU64])>,
    ) {
        self.published_leases = words;
        self.publish_leases();
    }

    /// Writes the open leases into the table; under the registry's lock, their one writer.
    pub(super) fn publish_leases(&self) {
        let Some((header, words)) = self.published_leases else {
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
        threadtable::write_leases(header, words, &open);
    }

    pub(super) fn publish(&self, slot: Slot) {
        let Some(record) = self.published.and_then(|t| t.get(slot as usize)) else {
            return;
        };
        let value = match self.entry(slot) {
            Some(e) => threadtable::encode(e.tid, e.role, e.placement),
            None => 0,
        };
        record.store(value, Ordering::Relaxed);
    }

    fn publish_all(&self) {
        if self.published.is_some() {
            for slot in 0..self.slots.len() as Slot {
                self.publish(slot);
            }
        }
    }
}
