//! "Did you mean" suggestions by edit distance.

/// Optimal-string-alignment distance: insertions, deletions, substitutions and transpositions of
/// adjacent characters each cost 1.
pub fn distance(a: &str, b: &str) -> usize {
    let a: Vec<char> = a.chars().collect();
    let b: Vec<char> = b.chars().collect();
    let mut prev2 = vec![0usize; b.len() + 1];
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    let mut cur = vec![0usize; b.len() + 1];
    for i in 1..=a.len() {
        cur[0] = i;
        for j in 1..=b.len() {
            let cost = usize::from(a[i - 1] != b[j - 1]);
            cur[j] = (prev[j] + 1).min(cur[j - 1] + 1).min(prev[j - 1] + cost);
            if i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1] {
                cur[j] = cur[j].min(prev2[j - 2] + 1);
            }
        }
        std::mem::swap(&mut prev2, &mut prev);
        std::mem::swap(&mut prev, &mut cur);
    }
    prev[b.len()]
}

/// The candidate closest to `word`, if it is close enough to be a plausible typo: within a third
/// of the word's length (at least 1, at most 4 edits), equal ignoring case, or equal to the last
/// dotted segment (`shard` → `megatron.shard`).
pub fn did_you_mean<'a, I>(word: &str, candidates: I) -> Option<&'a str>
where
    I: IntoIterator<Item = &'a str>,
{
    let limit = (word.chars().count() / 3).clamp(1, 4);
    let lower = word.to_lowercase();
    let mut best: Option<(usize, &'a str)> = None;
    for c in candidates {
        if c == word {
            continue;
        }
        let d = if c.to_lowercase() == lower || c.rsplit('.').next() == Some(word) {
            0
        } else {
            distance(&lower, &c.to_lowercase())
        };
        if d <= limit && best.is_none_or(|(bd, _)| d < bd) {
            best = Some((d, c));
        }
    }
    best.map(|(_, c)| c)
}

/// `` `a`, `b`, `c` ``
pub fn list(items: &[&str]) -> String {
    items.iter().map(|i| format!("`{i}`")).collect::<Vec<_>>().join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn distances() {
        assert_eq!(distance("", "abc"), 3);
        assert_eq!(distance("shrad", "shard"), 1);
        assert_eq!(distance("kitten", "sitting"), 3);
        assert_eq!(distance("same", "same"), 0);
    }

    #[test]
    fn suggestions() {
        let kinds = ["hf.download", "megatron.shard", "megatron.split_fused", "checkpoint.validate", "store.upload"];
        assert_eq!(did_you_mean("megatron.shrad", kinds), Some("megatron.shard"));
        assert_eq!(did_you_mean("shard", kinds), Some("megatron.shard"));
        assert_eq!(did_you_mean("Store.Upload", kinds), Some("store.upload"));
        assert_eq!(did_you_mean("tensorflow", kinds), None);
        assert_eq!(did_you_mean("descripton", ["name", "description", "steps"]), Some("description"));
        assert_eq!(did_you_mean("tpp", ["tp", "dp"]), Some("tp"));
        assert_eq!(did_you_mean("x", ["tp", "dp"]), None);
    }
}
