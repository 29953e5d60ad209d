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

    /// Parses a mesh written as assignments, `tp=2,dp=4,ep=2,etp=1` (the form of `reshard
    /// --from-mesh` and of a pipeline's `from_mesh`): `tp`, `cp`, `dp`, `ep` default to 1, `etp`
    /// to `tp`. The mesh is not checked ([`Mesh::check`]).
    pub fn parse_assignments(s: &str) -> Result<Mesh, String> {
        let mut m = Mesh { tp: 1, cp: 1, dp: 1, ep: 1, etp: 0 };
        let mut etp = None;
        let mut seen: Vec<&str> = Vec::new();
        for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (k, v) = part.split_once('=').ok_or_else(|| format!("`{part}` is not name=value"))?;
            let k = k.trim();
            let v: u64 = v.trim().parse().map_err(|_| format!("`{part}`: `{}` is not a whole number", v.trim()))?;
            if seen.contains(&k) {
                return Err(format!("`{k}` is given twice"));
            }
            match k {
                "tp" => m.tp = v,
                "cp" => m.cp = v,
                "dp" => m.dp = v,
                "ep" => m.ep = v,
                "etp" => etp = Some(v),
                other => return Err(format!("unknown dimension `{other}` (tp, cp, dp, ep, etp)")),
            }
            seen.push(k);
        }
        if seen.is_empty() {
            return Err("no dimension given (e.g. `tp=2,dp=4`)".to_string());
        }
        m.etp = etp.unwrap_or(m.tp);
        Ok(m)
    }

    /// The assignments form [`Mesh::parse_assignments`] reads, every dimension written.
    pub fn assignments(&self) -> String {
        format!("tp={},cp={},dp={},ep={},etp={}", self.tp, self.cp, self.dp, self.ep, self.etp)
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
    fn parses_assignments_with_defaults() {
        assert_eq!(Mesh::parse_assignments("tp=2,dp=4"), Ok(Mesh { tp: 2, cp: 1, dp: 4, ep: 1, etp: 2 }));
        assert_eq!(Mesh::parse_assignments("tp=2, dp=4, ep=2, etp=1"), Ok(Mesh { tp: 2, cp: 1, dp: 4, ep: 2, etp: 1 }));
        let m = Mesh { tp: 2, cp: 2, dp: 3, ep: 1, etp: 1 };
        assert_eq!(Mesh::parse_assignments(&m.assignments()), Ok(m));
        assert!(Mesh::parse_assignments("tp=2,pp=2").unwrap_err().contains("unknown dimension `pp`"));
        assert!(Mesh::parse_assignments("tp").unwrap_err().contains("name=value"));
        assert!(Mesh::parse_assignments("tp=x").unwrap_err().contains("whole number"));
        assert!(Mesh::parse_assignments("tp=1,tp=2").unwrap_err().contains("twice"));
        assert!(Mesh::parse_assignments("").is_err());
    }

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
