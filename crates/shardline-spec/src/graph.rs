//! The step graph by index: strongly connected components (cycles) and what lies upstream of
//! each step, in time linear in steps + needs (a generated spec may have thousands of steps).

use std::collections::{BTreeSet, HashMap};

use crate::model::StepKind;

/// Most `hf.download` steps remembered upstream of one step (enough to tell "one" from "many").
pub(crate) const MAX_DOWNLOADS: usize = 3;

pub(crate) struct Graph<'a> {
    pub ids: Vec<&'a str>,
    pub kinds: Vec<Option<StepKind>>,
    /// For each step, the steps it needs (deduplicated, known ids only), in written order.
    pub needs: Vec<Vec<usize>>,
    pub index: HashMap<&'a str, usize>,
}

/// What is upstream of a step (transitively; a step in a cycle is upstream of itself).
#[derive(Clone, Debug, Default)]
pub(crate) struct Upstream {
    /// A step whose output is a sharded checkpoint ([`StepKind::writes_checkpoint`]).
    pub has_checkpoint: bool,
    /// A `checkpoint.export` step (its output is an HF directory).
    pub has_export: bool,
    /// Distinct `hf.download` steps, at most [`MAX_DOWNLOADS`] + 1 (more means "several").
    pub downloads: BTreeSet<usize>,
}

impl<'a> Graph<'a> {
    /// Nodes in file order; needs naming unknown ids are left out.
    pub fn new(nodes: Vec<(&'a str, Option<StepKind>, Vec<&'a str>)>) -> Graph<'a> {
        let mut index = HashMap::new();
        for (i, (id, _, _)) in nodes.iter().enumerate() {
            index.entry(*id).or_insert(i);
        }
        let needs = nodes
            .iter()
            .map(|(_, _, needs)| {
                let mut out: Vec<usize> = Vec::new();
                let mut seen = BTreeSet::new();
                for n in needs {
                    if let Some(&j) = index.get(n) {
                        if seen.insert(j) {
                            out.push(j);
                        }
                    }
                }
                out
            })
            .collect();
        Graph { ids: nodes.iter().map(|n| n.0).collect(), kinds: nodes.iter().map(|n| n.1).collect(), needs, index }
    }

    pub fn len(&self) -> usize {
        self.ids.len()
    }

    /// Tarjan's strongly connected components, iteratively. Components come out needed-first
    /// (a component after every component it needs); nodes of each in file order.
    pub fn components(&self) -> Vec<Vec<usize>> {
        let n = self.len();
        let mut index = vec![usize::MAX; n];
        let mut low = vec![0; n];
        let mut on_stack = vec![false; n];
        let mut stack = Vec::new();
        let mut next = 0;
        let mut out = Vec::new();
        for root in 0..n {
            if index[root] != usize::MAX {
                continue;
            }
            let mut work: Vec<(usize, usize)> = vec![(root, 0)];
            while let Some(&mut (v, ref mut i)) = work.last_mut() {
                if *i == 0 && index[v] == usize::MAX {
                    index[v] = next;
                    low[v] = next;
                    next += 1;
                    stack.push(v);
                    on_stack[v] = true;
                }
                if *i < self.needs[v].len() {
                    let w = self.needs[v][*i];
                    *i += 1;
                    if index[w] == usize::MAX {
                        work.push((w, 0));
                    } else if on_stack[w] {
                        low[v] = low[v].min(index[w]);
                    }
                } else {
                    work.pop();
                    if let Some(&(u, _)) = work.last() {
                        low[u] = low[u].min(low[v]);
                    }
                    if low[v] == index[v] {
                        let mut comp = Vec::new();
                        while let Some(w) = stack.pop() {
                            on_stack[w] = false;
                            comp.push(w);
                            if w == v {
                                break;
                            }
                        }
                        comp.sort_unstable();
                        out.push(comp);
                    }
                }
            }
        }
        out
    }

    /// Whether a component is a cycle (more than one step, or a step that needs itself).
    pub fn is_cycle(&self, component: &[usize]) -> bool {
        component.len() > 1 || component.first().is_some_and(|&v| self.needs[v].contains(&v))
    }

    /// What is upstream of every step.
    pub fn upstream(&self, components: &[Vec<usize>]) -> Vec<Upstream> {
        let mut comp_of = vec![0; self.len()];
        for (c, comp) in components.iter().enumerate() {
            for &v in comp {
                comp_of[v] = c;
            }
        }
        let mut up: Vec<Upstream> = vec![Upstream::default(); components.len()];
        for (c, comp) in components.iter().enumerate() {
            let mut acc = Upstream::default();
            let cycle = self.is_cycle(comp);
            for &v in comp {
                if cycle {
                    add_node(&mut acc, v, self.kinds[v]);
                }
                for &w in &self.needs[v] {
                    let d = comp_of[w];
                    if d != c {
                        add_node(&mut acc, w, self.kinds[w]);
                        acc.has_checkpoint |= up[d].has_checkpoint;
                        acc.has_export |= up[d].has_export;
                        for &x in &up[d].downloads {
                            add_download(&mut acc, x);
                        }
                    }
                }
            }
            up[c] = acc;
        }
        (0..self.len()).map(|v| up[comp_of[v]].clone()).collect()
    }
}

fn add_node(acc: &mut Upstream, v: usize, kind: Option<StepKind>) {
    if kind.is_some_and(StepKind::writes_checkpoint) {
        acc.has_checkpoint = true;
    }
    match kind {
        Some(StepKind::CheckpointExport) => acc.has_export = true,
        Some(StepKind::HfDownload) => add_download(acc, v),
        _ => {}
    }
}

fn add_download(acc: &mut Upstream, v: usize) {
    if acc.downloads.len() <= MAX_DOWNLOADS {
        acc.downloads.insert(v);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn upstream_of_a_chain_and_a_cycle() {
        use StepKind::*;
        let g = Graph::new(vec![
            ("d", Some(HfDownload), vec![]),
            ("s", Some(MegatronShard), vec!["d", "unknown"]),
            ("v", Some(CheckpointValidate), vec!["s", "s"]),
            ("a", Some(StoreUpload), vec!["b"]),
            ("b", Some(StoreUpload), vec!["a"]),
        ]);
        assert_eq!(g.needs[2], vec![1]);
        let comps = g.components();
        let cycles: Vec<&Vec<usize>> = comps.iter().filter(|c| g.is_cycle(c)).collect();
        assert_eq!(cycles, vec![&vec![3, 4]]);
        let up = g.upstream(&comps);
        assert!(!up[1].has_checkpoint && up[1].downloads == BTreeSet::from([0]));
        assert!(up[2].has_checkpoint && up[2].downloads == BTreeSet::from([0]));
        assert!(!up[3].has_checkpoint && up[3].downloads.is_empty());
    }

    #[test]
    fn long_chains_are_linear() {
        let ids: Vec<String> = (0..50_000).map(|i| format!("s{i}")).collect();
        let nodes = ids
            .iter()
            .enumerate()
            .map(|(i, id)| {
                (
                    id.as_str(),
                    Some(StepKind::MegatronShard),
                    ids.get(i + 1).map(|n| vec![n.as_str()]).unwrap_or_default(),
                )
            })
            .collect();
        let g = Graph::new(nodes);
        let comps = g.components();
        assert_eq!(comps.len(), 50_000);
        let up = g.upstream(&comps);
        assert!(up[0].has_checkpoint && !up[49_999].has_checkpoint);
    }
}
