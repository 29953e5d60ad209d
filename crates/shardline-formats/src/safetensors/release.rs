//! A release directory: `config.json`, the index if any, and every shard's header, cross-checked.

use std::collections::HashMap;
use std::fmt;
use std::fs::{self, File};
use std::io::{self, Read};
use std::path::{Component, Path, PathBuf};

use serde::de::{Deserializer, Error as _, MapAccess, Visitor};
use serde::Deserialize;
use serde_json::error::Category;
use shardline_layout::SourceTensor;

use super::error::io_error;
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
                let index = parse_index(&index_path, &bytes)?;
                drop(bytes);
                Self::open_sharded(dir, config_json, index_path, index)
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
        index: Index,
    ) -> Result<Release, SafetensorsError> {
        let mut names: Vec<&str> = index.files.iter().map(String::as_str).collect();
        names.sort_unstable();
        for name in &names {
            if !stays_inside(name) {
                return Err(SafetensorsError::ShardPathEscapes { index: index_path, file: (*name).to_string() });
            }
        }
        let mut files = Vec::with_capacity(names.len());
        for name in &names {
            let path = dir.join(name);
            if !path.exists() {
                return Err(SafetensorsError::MissingShard { index: index_path, file: (*name).to_string(), path });
            }
            files.push(read_header(&path)?);
        }
        let release = Self::assemble(dir, config_json, Some(index_path), files)?;
        release.check_index(&index, &names)?;
        Ok(release)
    }

    /// Checks that the shards (`names[i]` holds `files[i]`) hold each tensor once, and each one
    /// where `index` says and nowhere else.
    fn check_index(&self, index: &Index, names: &[&str]) -> Result<(), SafetensorsError> {
        let index_path = || self.index_path.clone().unwrap_or_default();
        let file_name = |fi: usize| names.get(fi).copied().unwrap_or_default().to_string();
        // Tensors of one name are adjacent in `by_name`, in file order.
        let name = |entry: (u32, u32)| self.entry(entry).info.name.as_str();
        if let Some(pair) = self.by_name.windows(2).find(|pair| name(pair[0]) == name(pair[1])) {
            return Err(SafetensorsError::DuplicateAcrossFiles {
                dir: self.dir.clone(),
                tensor: name(pair[0]).to_string(),
                first: file_name(pair[0].0 as usize),
                second: file_name(pair[1].0 as usize),
            });
        }
        for (tensor, file) in &index.tensors {
            let file = index.files[*file as usize].as_str();
            let holds = names.binary_search(&file).is_ok_and(|fi| self.files[fi].tensor(tensor).is_some());
            if !holds {
                return Err(SafetensorsError::NotInFile {
                    index: index_path(),
                    tensor: tensor.clone(),
                    file: file.to_string(),
                    found_in: self.tensor(tensor).map(|t| file_name(t.file_index)),
                });
            }
        }
        for (fi, header) in self.files.iter().enumerate() {
            if let Some(t) = header.tensors().iter().find(|t| !index.lists(&t.name)) {
                return Err(SafetensorsError::NotInIndex {
                    index: index_path(),
                    tensor: t.name.clone(),
                    file: file_name(fi),
                });
            }
        }
        Ok(())
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
        // Stable: tensors of one name stay in file order.
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

/// The index's `weight_map`, each shard file named once: the files in order of first mention, and
/// the tensors sorted by name with the file that holds them (an index into `files`).
struct Index {
    files: Vec<String>,
    tensors: Vec<(String, u32)>,
}

impl Index {
    /// Whether the index lists tensor `name`.
    fn lists(&self, name: &str) -> bool {
        self.tensors.binary_search_by(|(t, _)| t.as_str().cmp(name)).is_ok()
    }
}

/// The index file: only `weight_map` is used; `metadata` (with its informational `total_size`)
/// and any other key are ignored.
#[derive(Deserialize)]
struct RawIndex {
    weight_map: WeightMap,
}

/// `weight_map` as it is read: its tensors in document order (duplicates kept).
struct WeightMap(Index);

impl<'de> Deserialize<'de> for WeightMap {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_map(WeightMapVisitor)
    }
}

struct WeightMapVisitor;

impl<'de> Visitor<'de> for WeightMapVisitor {
    type Value = WeightMap;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a json object whose values are strings")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut index = Index { files: Vec::new(), tensors: Vec::new() };
        let mut file_ids: HashMap<String, u32> = HashMap::new();
        while let Some((tensor, file)) = map.next_entry::<String, String>()? {
            let id = match file_ids.get(&file) {
                Some(&id) => id,
                None => {
                    let id = u32::try_from(index.files.len()).map_err(|_| A::Error::custom("too many files"))?;
                    index.files.push(file.clone());
                    file_ids.insert(file, id);
                    id
                }
            };
            index.tensors.push((tensor, id));
        }
        Ok(WeightMap(index))
    }
}

fn parse_index(path: &Path, bytes: &[u8]) -> Result<Index, SafetensorsError> {
    let mut index = match serde_json::from_slice::<RawIndex>(bytes) {
        Ok(raw) => raw.weight_map.0,
        Err(e) if e.classify() == Category::Data => {
            return Err(SafetensorsError::InvalidIndex { path: path.to_path_buf(), reason: e.to_string() })
        }
        Err(e) => return Err(SafetensorsError::IndexNotJson { path: path.to_path_buf(), reason: e.to_string() }),
    };
    index.tensors.sort_unstable_by(|a, b| a.0.cmp(&b.0));
    index.tensors.shrink_to_fit();
    if let Some(pair) = index.tensors.windows(2).find(|pair| pair[0].0 == pair[1].0) {
        return Err(SafetensorsError::InvalidIndex {
            path: path.to_path_buf(),
            reason: format!("tensor {:?} appears more than once in weight_map", pair[0].0),
        });
    }
    Ok(index)
}
