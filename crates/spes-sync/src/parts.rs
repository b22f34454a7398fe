//! Who reads which part of the corpus when `data.partition = "disjoint"`: every node declares
//! the parts its data directory holds when it joins, and no part has two live readers, so no
//! window is read twice. A part whose reader is gone (evicted, or its lease expired) passes to
//! the next node that declares it: an operator who moves a departed node's data to another
//! machine gets it read again from where the run is (a part's position follows the round).

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use thiserror::Error;

/// Why a claim of parts was refused.
#[derive(Clone, Debug, Error, PartialEq, Eq)]
pub enum PartError {
    #[error(
        "data part {part} is read by live node {holder}: two nodes reading one part would read \
         its windows twice; give node {peer} another part (spes tokenize --part)"
    )]
    Taken {
        part: String,
        holder: usize,
        peer: usize,
    },
    #[error(
        "node {peer} declares no data part, but the run has data.partition = \"disjoint\": point \
         its data.path at the output of spes tokenize --part p/N"
    )]
    None { peer: usize },
}

/// The reader of every part claimed so far, by part id (`spes_data::Manifest::part_id`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct PartBook {
    readers: BTreeMap<String, usize>,
}

impl PartBook {
    /// Gives `peer` the parts it declares, unless a live other node reads one of them (then
    /// nothing changes). `live(q)` says whether peer q holds a current lease.
    pub fn claim(
        &mut self,
        peer: usize,
        parts: &[String],
        live: impl Fn(usize) -> bool,
    ) -> Result<(), PartError> {
        if parts.is_empty() {
            return Err(PartError::None { peer });
        }
        for part in parts {
            if let Some(&holder) = self.readers.get(part) {
                if holder != peer && live(holder) {
                    return Err(PartError::Taken {
                        part: part.clone(),
                        holder,
                        peer,
                    });
                }
            }
        }
        // A node that comes back with other parts no longer reads the old ones.
        self.readers.retain(|_, r| *r != peer);
        for part in parts {
            self.readers.insert(part.clone(), peer);
        }
        Ok(())
    }

    /// The parts each of `members` reads, for the round record.
    pub fn of_members(&self, members: &[usize]) -> BTreeMap<usize, Vec<String>> {
        let mut out: BTreeMap<usize, Vec<String>> = BTreeMap::new();
        for (part, reader) in &self.readers {
            if members.contains(reader) {
                out.entry(*reader).or_default().push(part.clone());
            }
        }
        out
    }

    pub fn is_empty(&self) -> bool {
        self.readers.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn a_part_has_one_live_reader_and_passes_on_when_it_is_gone() {
        let mut book = PartBook::default();
        let all_live = |_| true;
        book.claim(0, &ids(&["c:0/4", "c:1/4"]), all_live).unwrap();
        book.claim(1, &ids(&["c:2/4"]), all_live).unwrap();
        let err = book
            .claim(2, &ids(&["c:3/4", "c:1/4"]), all_live)
            .unwrap_err();
        assert_eq!(
            err,
            PartError::Taken {
                part: "c:1/4".into(),
                holder: 0,
                peer: 2
            }
        );
        // The refused claim changed nothing; the same node claiming again is fine.
        book.claim(0, &ids(&["c:0/4", "c:1/4"]), all_live).unwrap();
        assert_eq!(book.of_members(&[0, 1, 2])[&0], ids(&["c:0/4", "c:1/4"]));
        assert!(!book.of_members(&[0, 1, 2]).contains_key(&2));
        // Node 0 is gone: node 2 takes its part over; node 0 keeps only what nobody took.
        book.claim(2, &ids(&["c:3/4", "c:1/4"]), |q| q != 0)
            .unwrap();
        let m = book.of_members(&[0, 1, 2]);
        assert_eq!(
            (m[&0].clone(), m[&2].clone()),
            (ids(&["c:0/4"]), ids(&["c:1/4", "c:3/4"]))
        );
        assert_eq!(
            book.claim(3, &[], all_live),
            Err(PartError::None { peer: 3 })
        );
        let json = serde_json::to_string(&book).unwrap();
        assert_eq!(serde_json::from_str::<PartBook>(&json).unwrap(), book);
    }
}
