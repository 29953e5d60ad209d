//! The parallel mesh of the target training job and its rank arithmetic.
//!
//! Ranks follow Megatron's default order `tp-cp-ep-dp` (TP fastest). Dense parameters live on the
//! mesh `(dp·cp) × tp`; expert parameters on `expert_dp × ep × etp`, with
//! `expert_dp = world / (etp·ep)`. Pipeline parallelism is 1 under FSDP.

use std::fmt;

use crate::error::LayoutError;

/// Sizes of the parallel dimensions of the target job.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Mesh {
    pub tp: u64,
    pub cp: u64,
    pub dp: u64,
    pub ep: u64,
    pub etp: u64,
}

impl Mesh {
    /// A mesh with `etp = tp`, Megatron's default.
    pub fn new(tp: u64, cp: u64, dp: u64, ep: u64) -> Mesh {
        Mesh { tp, cp, dp, ep, etp: tp }
    }

    /// Number of ranks of the job: `tp·cp·dp`.
    pub fn world(&self) -> u64 {
        self.tp * self.cp * self.dp
    }

    /// Size of the dense FSDP shard group, `dp·cp` (CP ranks are folded into it).
    pub fn fsdp_size(&self) -> u64 {
        self.dp * self.cp
    }

    /// Size of the expert data-parallel group, `world / (etp·ep)`.
    pub fn expert_dp_size(&self) -> u64 {
        self.world() / (self.etp * self.ep)
    }

    /// Global rank of TP rank `tp_rank` in dense FSDP rank `fsdp_rank`.
    pub fn dense_rank(&self, tp_rank: u64, fsdp_rank: u64) -> u64 {
        tp_rank + self.tp * fsdp_rank
    }

    /// Global rank of an expert-parallel coordinate.
    pub fn expert_rank(&self, etp_rank: u64, ep_rank: u64, expert_dp_rank: u64) -> u64 {
        etp_rank + self.etp * (ep_rank + self.ep * expert_dp_rank)
    }

    /// Checks the mesh on its own: positive sizes and an expert layout that tiles the world.
    pub fn check(&self) -> Vec<LayoutError> {
        let mut errors = Vec::new();
        for (name, v) in [("tp", self.tp), ("cp", self.cp), ("dp", self.dp), ("ep", self.ep), ("etp", self.etp)] {
            if v == 0 {
                errors.push(LayoutError::Mesh(format!("`{name}` must be at least 1, got 0")));
            }
        }
        if errors.is_empty() && !self.world().is_multiple_of(self.etp * self.ep) {
            errors.push(LayoutError::Mesh(format!(
                "world size tp·cp·dp = {}·{}·{} = {} is not divisible by etp·ep = {}·{} = {}",
                self.tp,
                self.cp,
                self.dp,
                self.world(),
                self.etp,
                self.ep,
                self.etp * self.ep
            )));
        }
        errors
    }
}

impl fmt::Display for Mesh {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "tp{}·cp{}·dp{}·ep{}·etp{}", self.tp, self.cp, self.dp, self.ep, self.etp)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rank_arithmetic() {
        let m = Mesh { tp: 2, cp: 2, dp: 2, ep: 2, etp: 2 };
        assert_eq!(m.world(), 8);
        assert_eq!(m.fsdp_size(), 4);
        assert_eq!(m.expert_dp_size(), 2);
        assert_eq!(m.dense_rank(1, 3), 7);
        assert_eq!(m.expert_rank(1, 1, 1), 7);
        assert!(m.check().is_empty());
    }

    #[test]
    fn rejects_untileable_expert_layout() {
        let m = Mesh { tp: 1, cp: 1, dp: 6, ep: 4, etp: 1 };
        let errs = m.check();
        assert_eq!(errs.len(), 1);
        assert!(errs[0].to_string().contains("6 is not divisible by etp·ep = 1·4 = 4"), "{}", errs[0]);
    }
}
