//! Steps that run as several tasks and a commit: a shard's plan, rank and commit tasks, a
//! reshard's rank tasks, an export's parts.

use shardline_spec::ResolvedStep;
use shardline_store::NewTask;

use super::{base, kinds, rank_task, ExportJob, Payload, ReshardJob, ReshardSource, ShardJob};

/// A reshard's tasks: one task per target rank file, each writing its file (into the staging
/// directory, or on an object-store artifact store putting it under the step's prefix), then the
/// reshard itself committing them; one task for one rank, or for a local source on an artifact
/// store (read in place on one host).
pub(super) fn reshard_tasks(step: &ResolvedStep, needs: Vec<String>, job: ReshardJob) -> Vec<NewTask> {
    let world = job.tp * job.cp * job.dp;
    let local_source = matches!(job.source, ReshardSource::Local { .. });
    if (job.remote.is_some() && local_source) || world < 2 {
        return vec![base(step, step.id.clone(), kinds::RESHARD, needs, Payload::Reshard { job })];
    }
    let job = ReshardJob { split: true, ..job };
    let mut tasks: Vec<NewTask> = (0..world)
        .map(|rank| {
            let payload = Payload::ReshardRank { job: job.clone(), rank };
            base(step, rank_task(&step.id, rank), kinds::RESHARD_RANK, needs.clone(), payload)
        })
        .collect();
    // The commit reads the source too (its `.metadata` and bytes items).
    let commit_needs = needs.into_iter().chain(tasks.iter().map(|t| t.name.clone())).collect();
    tasks.push(base(step, step.id.clone(), kinds::RESHARD, commit_needs, Payload::Reshard { job }));
    tasks
}

/// An export's tasks: with `parts` above 1 on a local or shared file system, one task per part
/// writing its weight files into the staging directory, then the export itself committing them;
/// otherwise (or on an object-store artifact store) one task.
pub(super) fn export_tasks(step: &ResolvedStep, needs: Vec<String>, job: ExportJob) -> Vec<NewTask> {
    if job.remote.is_some() || job.parts < 2 {
        let job = ExportJob { parts: 1, ..job };
        return vec![base(step, step.id.clone(), kinds::EXPORT, needs, Payload::Export { job })];
    }
    let mut tasks: Vec<NewTask> = (0..job.parts)
        .map(|part| {
            let payload = Payload::ExportPart { job: job.clone(), part };
            base(step, format!("{}/part-{part}", step.id), kinds::EXPORT_PART, needs.clone(), payload)
        })
        .collect();
    let commit_needs = needs.into_iter().chain(tasks.iter().map(|t| t.name.clone())).collect();
    tasks.push(base(step, step.id.clone(), kinds::EXPORT, commit_needs, Payload::Export { job }));
    tasks
}

pub(super) fn fan_out(tasks: &mut Vec<NewTask>, step: &ResolvedStep, name: &str, needs: Vec<String>, job: ShardJob) {
    let plan = name.to_string();
    tasks.push(base(step, plan.clone(), kinds::PLAN, needs, Payload::Plan { job: job.clone() }));
    let mut ranks = Vec::new();
    for rank in 0..job.world() {
        let n = rank_task(&plan, rank);
        ranks.push(n.clone());
        tasks.push(base(
            step,
            n,
            kinds::RANK,
            vec![plan.clone()],
            Payload::Rank { job: job.clone(), plan_task: plan.clone(), rank },
        ));
    }
    tasks.push(base(step, format!("{name}/commit"), kinds::COMMIT, ranks, Payload::Commit { job, plan_task: plan }));
}
