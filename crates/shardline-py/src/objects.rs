//! A pickled Python object (a DCP bytes item: Megatron's `args`, `iteration`, RNG states…) turned
//! into Python values without running the pickle. The formats crate reads pickles as data
//! ([`Value`]); here plain values become themselves, two harmless classes are rebuilt
//! (`argparse.Namespace`, `collections.OrderedDict`, plus protocol 2's `_codecs.encode` for
//! bytes), and every other construction becomes a `PickledObject` that only describes it. So
//! reading a checkpoint's objects never imports or calls what the checkpoint names.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyFrozenSet, PyList, PySet, PyString, PyTuple};
use shardline_formats::pickle::Value;

/// What a pickle would construct and from what: `callable` is `module.name`; `args`, `kwargs`,
/// `state`, `items` (appended) and `dict_items` (set) as the pickle gives them, converted the
/// same way. A bare global reference has only `callable`.
#[pyclass(frozen, get_all, module = "shardline")]
pub struct PickledObject {
    callable: String,
    args: Py<PyAny>,
    kwargs: Py<PyAny>,
    state: Py<PyAny>,
    items: Py<PyAny>,
    dict_items: Py<PyAny>,
}

#[pymethods]
impl PickledObject {
    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        let mut parts = Vec::new();
        for (name, v) in [("args", &self.args), ("kwargs", &self.kwargs), ("state", &self.state)] {
            if !v.is_none(py) {
                parts.push(format!("{name}={}", v.bind(py).repr()?));
            }
        }
        Ok(format!("PickledObject({}{}{})", self.callable, if parts.is_empty() { "" } else { ", " }, parts.join(", ")))
    }
}

fn global_name(value: &Value) -> Option<String> {
    match value {
        Value::Global { module, name } => Some(format!("{module}.{name}")),
        _ => None,
    }
}

fn optional<'py>(py: Python<'py>, value: Option<&Value>) -> PyResult<Py<PyAny>> {
    Ok(match value {
        Some(v) => to_python(py, v)?.unbind(),
        None => py.None(),
    })
}

fn list<'py>(py: Python<'py>, values: &[Value]) -> PyResult<Bound<'py, PyList>> {
    let items = values.iter().map(|v| to_python(py, v)).collect::<PyResult<Vec<_>>>()?;
    PyList::new(py, items)
}

fn dict<'py>(py: Python<'py>, pairs: &[(Value, Value)]) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    for (k, v) in pairs {
        d.set_item(to_python(py, k)?, to_python(py, v)?)?;
    }
    Ok(d)
}

fn described<'py>(
    py: Python<'py>,
    callable: String,
    args: Option<&Value>,
    kwargs: Option<&Value>,
    state: Option<&Value>,
    items: &[Value],
    dict_items: &[(Value, Value)],
) -> PyResult<Bound<'py, PyAny>> {
    let object = PickledObject {
        callable,
        args: optional(py, args)?,
        kwargs: optional(py, kwargs)?,
        state: optional(py, state)?,
        items: if items.is_empty() { py.None() } else { list(py, items)?.into_any().unbind() },
        dict_items: if dict_items.is_empty() { py.None() } else { dict(py, dict_items)?.into_any().unbind() },
    };
    Ok(Bound::new(py, object)?.into_any())
}

/// `value` as a Python object (see the module's note on what is rebuilt).
pub fn to_python<'py>(py: Python<'py>, value: &Value) -> PyResult<Bound<'py, PyAny>> {
    Ok(match value {
        Value::None => py.None().into_bound(py),
        Value::Bool(b) => b.into_pyobject(py)?.to_owned().into_any(),
        Value::Int(i) => i.into_pyobject(py)?.into_any(),
        Value::Float(f) => f.into_pyobject(py)?.into_any(),
        Value::Str(s) => PyString::new(py, s).into_any(),
        Value::Bytes(b) => PyBytes::new(py, b).into_any(),
        Value::Tuple(items) => {
            PyTuple::new(py, items.iter().map(|v| to_python(py, v)).collect::<PyResult<Vec<_>>>()?)?.into_any()
        }
        Value::List(items) => list(py, items)?.into_any(),
        Value::Dict(pairs) => dict(py, pairs)?.into_any(),
        Value::Set(items) => {
            PySet::new(py, items.iter().map(|v| to_python(py, v)).collect::<PyResult<Vec<_>>>()?)?.into_any()
        }
        Value::FrozenSet(items) => {
            PyFrozenSet::new(py, items.iter().map(|v| to_python(py, v)).collect::<PyResult<Vec<_>>>()?)?.into_any()
        }
        Value::Global { module, name } => described(py, format!("{module}.{name}"), None, None, None, &[], &[])?,
        Value::Reduce { callable, args, state, list_items, dict_items } => {
            let name = global_name(callable).unwrap_or_else(|| "<computed callable>".to_string());
            match (name.as_str(), args.as_ref()) {
                // Protocol 2's encoding of `bytes`.
                ("_codecs.encode", Value::Tuple(a)) if matches!(a.as_slice(), [Value::Str(_), Value::Str(e)] if e == "latin1") =>
                {
                    let Value::Str(s) = &a[0] else { unreachable!("matched above") };
                    let bytes: Vec<u8> =
                        s.chars().map(|c| c as u32).map(u8::try_from).collect::<Result<_, _>>().map_err(|_| {
                            PyValueError::new_err("a latin1-encoded bytes value holds a character above U+00FF")
                        })?;
                    PyBytes::new(py, &bytes).into_any()
                }
                ("collections.OrderedDict", _) if state.is_none() && list_items.is_empty() => {
                    dict(py, dict_items)?.into_any()
                }
                _ => described(py, name, Some(args), None, state.as_deref(), list_items, dict_items)?,
            }
        }
        Value::Object { class, args, kwargs, state, list_items, dict_items } => {
            let name = global_name(class).unwrap_or_else(|| "<computed class>".to_string());
            match (name.as_str(), state.as_deref()) {
                ("argparse.Namespace", Some(Value::Dict(fields))) if list_items.is_empty() && dict_items.is_empty() => {
                    let namespace = py.import("argparse")?.getattr("Namespace")?;
                    namespace.call((), Some(&dict(py, fields)?))?
                }
                _ => described(py, name, Some(args), kwargs.as_deref(), state.as_deref(), list_items, dict_items)?,
            }
        }
        Value::PersistentId(pid) => described(py, "persistent_id".to_string(), Some(pid), None, None, &[], &[])?,
    })
}
