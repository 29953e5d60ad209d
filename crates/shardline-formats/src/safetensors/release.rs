//! A release directory: `config.json`, the index if any, and every shard's header, cross-checked.

use std::collections::{BTreeSet, HashMap};
use std::fs::{self, File};
use std::io::{self, Read};
use std::path::{Component, Path, PathBuf};

use serde::de::{DeserializeSeed, Deserializer};
use serde::Deserialize;
use serde_json::error::Category;
use shardline_layout::SourceTensor;

use super::error::io_error;
use super::header::StringPairs;
use super::*;

/// A tensor of a release and the file that holds it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReleaseTensor<'a> {
    /// Index into [`Release::files`].
    pub file_index: usize,
    pub info: &'a TensorInfo,
}

/// A checked HuggingFace safetensors release: `config.json` plus one `model.safetensors`, or the
/// shards listed by `model.safetensors.index.json`.
#[derive(Clone, Debug)]
pub struct Release {
    dir: PathBuf,
    config_json: String,
    index_path: Option<PathBuf>,
    /// Sorted by path.
    files: Vec<FileHeader>,
    /// Every tensor as `(file index, index in that file's header)`, sorted by name: the headers
    /// hold each tensor's description once, however many tensors a release has.
    by_name: Vec<(u32, u32)>,
    total_bytes: u64,
}

impl Release {
    /// Opens the release in `dir`, reading `config.json`, the index if any, and every shard's
    /// header (never tensor data), and checks that the index and the shards agree exactly.
    pub fn open(dir: impl AsRef<Path>) -> Result<Release, SafetensorsError> {
        let dir = dir.as_ref();
        let meta = fs::metadata(dir).map_err(io_error(dir, "open release directory"))?;
        if !meta.is_dir() {
            return Err(SafetensorsError::Io {
                path: dir.to_path_buf(),
                action: "open release directory",
                source: io::Error::other("not a directory"),
            });
        }

        let config_path = dir.join(CONFIG_FILE_NAME);
        let config_json = match read_bounded(&config_path, MAX_CONFIG_LEN, "read config.json")? {
            Some(bytes) => String::from_utf8(bytes)
                .map_err(|e| SafetensorsError::NotUtf8 { path: config_path.clone(), reason: e.to_string() })?,
            None => return Err(SafetensorsError::MissingConfig { dir: dir.to_path_buf() }),
        };

        let index_path = dir.join(INDEX_FILE_NAME);
        match read_bounded(&index_path, MAX_INDEX_LEN, "read the index")? {
            Some(bytes) => {
                let weight_map = parse_index(&index_path, &bytes)?;
                drop(bytes);
                Self::open_sharded(dir, config_json, index_path, weight_map)
            }
            None => {
                let path = dir.join(SINGLE_FILE_NAME);
                if !path.exists() {
                    return Err(SafetensorsError::NoWeights { dir: dir.to_path_buf() });
                }
                let header = read_header(&path)?;
                Self::assemble(dir, config_json, None, vec![header])
            }
        }
    }

    fn open_sharded(
        dir: &Path,
        config_json: String,
        index_path: PathBuf,
        weight_map: Vec<(String, String)>,
    ) -> Result<Release, SafetensorsError> {
        let mut mapped: HashMap<&str, &str> = HashMap::with_capacity(weight_map.len());
        for (tensor, file) in &weight_map {
            if mapped.insert(tensor, file).is_some() {
                return Err(SafetensorsError::InvalidIndex {
                    path: index_path,
                    reason: format!("tensor {tensor:?} appears more than once in weight_map"),
                });
            }
        }

        let names: BTreeSet<&str> = weight_map.iter().map(|(_, f)| f.as_str()).collect();
        for name in &names {
            if !stays_inside(name) {
                return Err(SafetensorsError::ShardPathEscapes { index: index_path, file: (*name).to_string() });
            }
        }
        let names: Vec<&str> = names.into_iter().collect();
        let mut files = Vec::with_capacity(names.len());
        for name in &names {
            let path = dir.join(name);
            if !path.exists() {
                return Err(SafetensorsError::MissingShard { index: index_path, file: (*name).to_string(), path });
            }
            files.push(read_header(&path)?);
        }

        // Which file holds each tensor, according to the shards themselves.
        let mut owner: HashMap<&str, usize> = HashMap::new();
        for (fi, header) in files.iter().enumerate() {
            for t in header.tensors() {
                if let Some(&first) = owner.get(t.name.as_str()) {
                    return Err(SafetensorsError::DuplicateAcrossFiles {
                        dir: dir.to_path_buf(),
                        tensor: t.name.clone(),
                        first: names.get(first).copied().unwrap_or_default().to_string(),
                        second: names.get(fi).copied().unwrap_or_default().to_string(),
                    });
                }
                owner.insert(&t.name, fi);
            }
        }
        let file_name = |fi: usize| names.get(fi).copied().unwrap_or_default().to_string();

        let mut sorted_map: Vec<(&str, &str)> = mapped.iter().map(|(t, f)| (*t, *f)).collect();
        sorted_map.sort_unstable();
        for (tensor, file) in sorted_map {
            let fi = names.binary_search(&file).ok();
            let holds = fi.and_then(|fi| files.get(fi)).is_some_and(|h| h.tensor(tensor).is_some());
            if !holds {
                return Err(SafetensorsError::NotInFile {
                    index: index_path,
                    tensor: tensor.to_string(),
                    file: file.to_string(),
                    found_in: owner.get(tensor).map(|&o| file_name(o)),
                });
            }
        }
        for (fi, header) in files.iter().enumerate() {
            if let Some(t) = header.tensors().iter().find(|t| !mapped.contains_key(t.name.as_str())) {
                return Err(SafetensorsError::NotInIndex {
                    index: index_path,
                    tensor: t.name.clone(),
                    file: file_name(fi),
                });
            }
        }
        drop(owner);
        drop(mapped);

        Self::assemble(dir, config_json, Some(index_path), files)
    }

    fn assemble(
        dir: &Path,
        config_json: String,
        index_path: Option<PathBuf>,
        files: Vec<FileHeader>,
    ) -> Result<Release, SafetensorsError> {
        let count: usize = files.iter().map(|h| h.tensors().len()).sum();
        let mut by_name = Vec::with_capacity(count);
        let mut total_bytes = 0u64;
        for (file_index, header) in files.iter().enumerate() {
            for (i, info) in header.tensors().iter().enumerate() {
                total_bytes = total_bytes
                    .checked_add(info.byte_len)
                    .ok_or_else(|| SafetensorsError::TotalOverflow { dir: dir.to_path_buf() })?;
                let index =
                    |n: usize| u32::try_from(n).map_err(|_| SafetensorsError::TotalOverflow { dir: dir.to_path_buf() });
                by_name.push((index(file_index)?, index(i)?));
            }
        }
        let name = |&(f, i): &(u32, u32)| files[f as usize].tensors[i as usize].name.as_str();
        by_name.sort_by(|a, b| name(a).cmp(name(b)));
        Ok(Release { dir: dir.to_path_buf(), config_json, index_path, files, by_name, total_bytes })
    }

    /// The release directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The contents of `config.json`.
    pub fn config_json(&self) -> &str {
        &self.config_json
    }

    /// The index file, for a sharded release.
    pub fn index_path(&self) -> Option<&Path> {
        self.index_path.as_deref()
    }

    /// The safetensors files, sorted by path; [`ReleaseTensor::file_index`] indexes this.
    pub fn files(&self) -> &[FileHeader] {
        &self.files
    }

    /// The paths of the safetensors files, in the order of [`Release::files`].
    pub fn file_paths(&self) -> impl Iterator<Item = &Path> + '_ {
        self.files.iter().map(FileHeader::path)
    }

    /// Every tensor of the release, sorted by name.
    pub fn tensors(&self) -> impl ExactSizeIterator<Item = ReleaseTensor<'_>> + Clone + '_ {
        self.by_name.iter().map(|&entry| self.entry(entry))
    }

    fn entry(&self, (file, index): (u32, u32)) -> ReleaseTensor<'_> {
        ReleaseTensor { file_index: file as usize, info: &self.files[file as usize].tensors[index as usize] }
    }

    /// Looks a tensor up by name.
    pub fn tensor(&self, name: &str) -> Option<ReleaseTensor<'_>> {
        let i = self.by_name.binary_search_by(|&e| self.entry(e).info.name.as_str().cmp(name)).ok()?;
        Some(self.entry(self.by_name[i]))
    }

    /// The file holding the tensor `name`, and the tensor.
    pub fn locate(&self, name: &str) -> Option<(&FileHeader, &TensorInfo)> {
        let t = self.tensor(name)?;
        Some((self.files.get(t.file_index)?, t.info))
    }

    /// Sum of the byte lengths of all tensors.
    pub fn total_bytes(&self) -> u64 {
        self.total_bytes
    }

    /// Every tensor of the release, sorted by name, as a plan's sources, and where each one's
    /// bytes are (`locations.tensors[i]` holds `sources[i]`). The headers' names and shapes move
    /// into the sources instead of being copied, so a large release is described once, not twice,
    /// while it is planned.
    pub fn into_sources(self) -> (Vec<SourceTensor>, SourceLocations) {
        let Release { mut files, by_name, .. } = self;
        let mut sources = Vec::with_capacity(by_name.len());
        let mut tensors = Vec::with_capacity(by_name.len());
        for (file, index) in by_name {
            let info = &mut files[file as usize].tensors[index as usize];
            sources.push(SourceTensor {
                name: std::mem::take(&mut info.name),
                dtype: info.dtype,
                shape: std::mem::take(&mut info.shape),
            });
            tensors.push((file, info.file_offset, info.byte_len));
        }
        let files = files.into_iter().map(|f| f.path).collect();
        (sources, SourceLocations { files, tensors })
    }
}

/// Where the bytes of a release's tensors are: its files, and for each tensor `(file index,
/// absolute data offset, byte length)`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SourceLocations {
    pub files: Vec<PathBuf>,
    pub tensors: Vec<(u32, u64, u64)>,
}

/// Whether a file name from an index stays inside the release directory: relative, and made only
/// of plain components (no `..`, no root, no drive prefix). Symbolic links are followed as usual,
/// since the HuggingFace cache links every file of a snapshot into a blob store.
fn stays_inside(name: &str) -> bool {
    let path = Path::new(name);
    let mut plain = 0usize;
    for component in path.components() {
        match component {
            Component::Normal(_) => plain += 1,
            Component::CurDir => {}
            Component::ParentDir | Component::RootDir | Component::Prefix(_) => return false,
        }
    }
    plain > 0
}

/// Reads a whole file of at most `limit` bytes; `Ok(None)` when it does not exist.
fn read_bounded(path: &Path, limit: u64, action: &'static str) -> Result<Option<Vec<u8>>, SafetensorsError> {
    let file = match File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(io_error(path, action)(e)),
    };
    let mut bytes = Vec::new();
    file.take(limit.saturating_add(1)).read_to_end(&mut bytes).map_err(io_error(path, action))?;
    if bytes.len() as u64 > limit {
        return Err(SafetensorsError::FileTooLarge { path: path.to_path_buf(), limit });
    }
    Ok(Some(bytes))
}

/// The index file: only `weight_map` is used; `metadata` (with its informational `total_size`)
/// and any other key are ignored.
#[derive(Deserialize)]
struct RawIndex {
    weight_map: WeightMap,
}

struct WeightMap(Vec<(String, String)>);

impl<'de> Deserialize<'de> for WeightMap {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        StringPairs.deserialize(deserializer).map(WeightMap)
    }
}

fn parse_index(path: &Path, bytes: &[u8]) -> Result<Vec<(String, String)>, SafetensorsError> {
    match serde_json::from_slice::<RawIndex>(bytes) {
        Ok(index) => Ok(index.weight_map.0),
        Err(e) if e.classify() == Category::Data => {
            Err(SafetensorsError::InvalidIndex { path: path.to_path_buf(), reason: e.to_string() })
        }
        Err(e) => Err(SafetensorsError::IndexNotJson { path: path.to_path_buf(), reason: e.to_string() }),
    }
}
