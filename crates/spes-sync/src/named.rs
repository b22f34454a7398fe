//! Named tensors and the model's layout: the vocabulary every other module of spes-sync speaks.

use spes_model::{MoeModel, Role};
use std::collections::{BTreeSet, HashMap};
use tch::Tensor;

/// Named tensors, in the model's parameter order.
pub type Named = Vec<(String, Tensor)>;

/// The model's parameter names, roles and shapes: what uploads are checked against. A server
/// shard's layout holds its slice of them ([`Layout::shard`]).
#[derive(Clone, Debug)]
pub struct Layout {
    /// Name, role and shape of every tensor, in parameter order (built by [`Layout::new`],
    /// which indexes them).
    pub entries: Vec<(String, Role, Vec<i64>)>,
    pub n_layers: usize,
    pub n_experts: usize,
    /// Position of each name in `entries`.
    index: HashMap<String, usize>,
}

impl Layout {
    /// The layout of a whole model.
    pub fn of(model: &MoeModel) -> Self {
        Layout::new(
            model
                .params()
                .into_iter()
                .map(|p| (p.name, p.role, p.tensor.size()))
                .collect(),
            model.cfg.n_layers,
            model.cfg.n_experts,
        )
    }

    /// A layout of these entries (name, role, shape), in parameter order.
    pub fn new(entries: Vec<(String, Role, Vec<i64>)>, n_layers: usize, n_experts: usize) -> Self {
        let index = entries
            .iter()
            .enumerate()
            .map(|(i, (n, _, _))| (n.clone(), i))
            .collect();
        Layout {
            entries,
            n_layers,
            n_experts,
            index,
        }
    }

    /// The tensors server shard `i` of `k` owns (`spes server --shard i/k`): whole layers (so a
    /// layer's experts merge on one shard) and whole other tensors, dealt largest first to the
    /// least loaded shard, so every shard and node computes the same split.
    pub fn shard(&self, i: usize, k: usize) -> Layout {
        let unit_of = |name: &str| -> String {
            name.strip_prefix("model.layers.")
                .and_then(|rest| rest.split('.').next())
                .map_or(name.to_owned(), |l| format!("model.layers.{l}."))
        };
        let mut sizes: Vec<(String, i64)> = Vec::new();
        for (name, _, shape) in &self.entries {
            let unit = unit_of(name);
            let n: i64 = shape.iter().product();
            match sizes.iter_mut().find(|(u, _)| *u == unit) {
                Some((_, s)) => *s += n,
                None => sizes.push((unit, n)),
            }
        }
        sizes.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
        let mut load = vec![0i64; k.max(1)];
        let mut mine = BTreeSet::new();
        for (unit, n) in sizes {
            let least = (0..load.len())
                .min_by_key(|&s| (load[s], s))
                .expect("k ≥ 1");
            load[least] += n;
            if least == i {
                mine.insert(unit);
            }
        }
        Layout::new(
            self.entries
                .iter()
                .filter(|(n, _, _)| mine.contains(&unit_of(n)))
                .cloned()
                .collect(),
            self.n_layers,
            self.n_experts,
        )
    }

    /// Whether this layout holds a tensor of that name.
    pub fn holds(&self, name: &str) -> bool {
        self.index.contains_key(name)
    }

    /// The shape of tensor `name`, if this layout holds it.
    pub fn shape_of(&self, name: &str) -> Option<&[i64]> {
        self.position(name).map(|i| self.entries[i].2.as_slice())
    }

    /// Where tensor `name` stands in `entries`.
    pub fn position(&self, name: &str) -> Option<usize> {
        self.index.get(name).copied()
    }
}

/// Shallow copies of a map's tensors, by name in sorted order (what a saved state holds).
pub fn sorted(map: &HashMap<String, Tensor>) -> Named {
    let mut named: Named = map
        .iter()
        .map(|(n, t)| (n.clone(), t.shallow_clone()))
        .collect();
    named.sort_by(|a, b| a.0.cmp(&b.0));
    named
}
