//! A decoder layer's tensors: attention, norms, router and experts, and the order its kernels
//! stack the experts in (trained first).

use tch::{Device, Tensor};

pub(super) struct Expert {
    pub(super) gate: Tensor, // W1 [hidden, d]
    pub(super) up: Tensor,   // V1 [hidden, d]
    pub(super) down: Tensor, // W2 [d, hidden]
}

impl Expert {
    /// Puts the masters where a trained or a frozen expert keeps them: on `device` with
    /// gradients when trained; when frozen, in host memory if `resident` (bf16 copies on the
    /// device serve the forward pass), else on `device`. A master that moves is a new leaf.
    pub(super) fn place(&mut self, train: bool, resident: bool, device: Device) {
        let home = if resident && !train {
            Device::Cpu
        } else {
            device
        };
        for w in [&mut self.gate, &mut self.up, &mut self.down] {
            if w.device() != home {
                *w = w.detach().to_device(home);
            }
            let _ = w.set_requires_grad(train);
        }
    }
}

/// A layer's experts in the order its kernels stack them: the trained ones first, then the
/// frozen, so that one grouped matmul computes weight gradients for a prefix of the stack
/// alone. Made by [`MoeModel::set_trainable`], the one place that changes which experts train.
pub(super) struct Slots {
    /// The expert in each slot.
    pub(super) expert_of: Vec<usize>,
    /// The slot of each expert.
    pub(super) slot_of: Vec<usize>,
    /// The first `trained` slots hold the trained experts.
    pub(super) trained: usize,
    /// `slot_of` and `expert_of` as int64 tensors on the model's device.
    pub(super) slot_of_t: Tensor,
    pub(super) expert_of_t: Tensor,
    /// With frozen experts resident in bf16: every slot's gate and up stacked `[E, 2·hidden,
    /// d]` and down `[E, d, hidden]`, bf16 on the device. The frozen slots hold the resident
    /// copies; each step's compute copies fill the trained slots.
    pub(super) resident: Option<[Tensor; 2]>,
}

impl Slots {
    /// Slots for experts of which `trains[e]` says which train.
    pub(super) fn new(trains: &[bool], device: Device) -> Self {
        let n = trains.len();
        let mut expert_of: Vec<usize> = (0..n).filter(|&e| trains[e]).collect();
        let trained = expert_of.len();
        expert_of.extend((0..n).filter(|&e| !trains[e]));
        let mut slot_of = vec![0; n];
        for (s, &e) in expert_of.iter().enumerate() {
            slot_of[e] = s;
        }
        let on_device = |v: &[usize]| {
            let v: Vec<i64> = v.iter().map(|&x| x as i64).collect();
            Tensor::from_slice(&v).to_device(device)
        };
        Slots {
            slot_of_t: on_device(&slot_of),
            expert_of_t: on_device(&expert_of),
            expert_of,
            slot_of,
            trained,
            resident: None,
        }
    }
}

pub(super) struct Layer {
    /// Pre-norm: normalises the attention input. Post-norm: the attention output.
    pub(super) attn_norm: Tensor,
    pub(super) q_proj: Tensor,
    pub(super) k_proj: Tensor,
    pub(super) v_proj: Tensor,
    pub(super) o_proj: Tensor,
    pub(super) qkv_bias: Option<[Tensor; 3]>,
    pub(super) q_norm: Option<Tensor>,
    pub(super) k_norm: Option<Tensor>,
    /// Pre-norm: normalises the MoE input. Post-norm: the MoE output.
    pub(super) ffn_norm: Tensor,
    pub(super) router: Tensor, // [E, d]
    pub(super) experts: Vec<Expert>,
    pub(super) slots: Slots,
}

impl Layer {
    /// Copies the frozen experts' masters into their resident slots (after the masters
    /// changed; once per round, not per step).
    pub(super) fn refresh_resident(&self) {
        let Some([gate_up, down]) = &self.slots.resident else {
            return;
        };
        tch::no_grad(|| {
            for (s, &e) in self
                .slots
                .expert_of
                .iter()
                .enumerate()
                .skip(self.slots.trained)
            {
                let (ex, s) = (&self.experts[e], s as i64);
                let h = ex.gate.size()[0];
                gate_up.get(s).narrow(0, 0, h).copy_(&ex.gate);
                gate_up.get(s).narrow(0, h, h).copy_(&ex.up);
                down.get(s).copy_(&ex.down);
            }
        });
    }
}
