//! Python values in: token ids and namespaces, checked with messages that name the bad value.

use crate::wire::hash::Namespace;
use numpy::{PyArray1, PyArrayDescrMethods, PyArrayMethods, PyUntypedArray, PyUntypedArrayMethods};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyByteArray, PyBytes, PyInt, PyList, PyString, PyTuple};

fn bad_id(what: &str, i: usize, v: impl std::fmt::Display) -> PyErr {
    PyValueError::new_err(format!(
        "{what}[{i}] = {v} is not a valid token id (0 <= id < 2**32)"
    ))
}

fn from_slice<T: Copy + Into<i128>>(
    what: &str,
    xs: impl Iterator<Item = T>,
    n: usize,
) -> PyResult<Vec<u32>> {
    let mut out = Vec::with_capacity(n);
    for (i, x) in xs.enumerate() {
        let v: i128 = x.into();
        if !(0..1 << 32).contains(&v) {
            return Err(bad_id(what, i, v));
        }
        out.push(v as u32);
    }
    Ok(out)
}

macro_rules! try_dtypes {
    ($what:expr, $arr:expr, $($t:ty),*) => {
        $(
            if let Ok(a) = $arr.downcast::<PyArray1<$t>>() {
                let ro = a.readonly();
                return match ro.as_slice() {
                    Ok(s) => from_slice($what, s.iter().copied(), s.len()),
                    Err(_) => {
                        let view = ro.as_array();
                        from_slice($what, view.iter().copied(), view.len())
                    }
                };
            }
        )*
    };
}

fn from_array(what: &str, arr: &Bound<'_, PyUntypedArray>) -> PyResult<Vec<u32>> {
    if arr.ndim() != 1 {
        return Err(PyValueError::new_err(format!(
            "{what} must be 1-D, got an array of shape {:?}",
            arr.shape()
        )));
    }
    if let Ok(a) = arr.downcast::<PyArray1<u32>>() {
        let ro = a.readonly();
        if let Ok(s) = ro.as_slice() {
            return Ok(s.to_vec());
        }
        return Ok(ro.as_array().to_vec());
    }
    try_dtypes!(what, arr, i64, i32, u64, u16, i16, u8, i8);
    let dtype = arr.dtype();
    if matches!(dtype.kind(), b'i' | b'u') && !dtype.is_native_byteorder().unwrap_or(true) {
        // An integer array in the other byte order: swap it once into native order.
        let native = arr.call_method1("astype", (dtype.call_method1("newbyteorder", ("=",))?,))?;
        if let Ok(native) = native.downcast::<PyUntypedArray>() {
            if native.dtype().is_native_byteorder().unwrap_or(false) {
                return from_array(what, native);
            }
        }
    }
    Err(PyTypeError::new_err(format!(
        "{what} must hold integers, got an array of dtype {}",
        arr.dtype().str()?
    )))
}

/// Token ids from a list/tuple of ints, a 1-D integer numpy array, a 1-D CPU torch tensor, or any
/// integer buffer (`array.array`, ...). Contiguous arrays are read without building Python ints.
pub fn tokens(what: &str, obj: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
    if let Ok(arr) = obj.downcast::<PyUntypedArray>() {
        return from_array(what, arr);
    }
    if obj.is_instance_of::<PyList>() || obj.is_instance_of::<PyTuple>() {
        let mut out = Vec::with_capacity(obj.len()?);
        for (i, item) in obj.try_iter()?.enumerate() {
            let item = item?;
            if item.is_instance_of::<PyBool>() {
                return Err(PyTypeError::new_err(format!(
                    "{what}[{i}] must be an int, got bool"
                )));
            }
            match item.extract::<i64>() {
                Ok(v) if (0..1 << 32).contains(&v) => out.push(v as u32),
                Ok(v) => return Err(bad_id(what, i, v)),
                Err(_) => match as_int(&item) {
                    // An int (or numpy integer) beyond 64 bits: out of range, not mistyped.
                    Some(v) => return Err(bad_id(what, i, v)),
                    None => {
                        return Err(PyTypeError::new_err(format!(
                            "{what}[{i}] must be an int, got {}",
                            item.get_type().name()?
                        )))
                    }
                },
            }
        }
        return Ok(out);
    }
    if obj.is_instance_of::<PyString>()
        || obj.is_instance_of::<PyBytes>()
        || obj.is_instance_of::<PyByteArray>()
    {
        return Err(PyTypeError::new_err(format!(
            "{what} must be token ids, got {}: tokenize text first",
            obj.get_type().name()?
        )));
    }
    let ty = obj.get_type();
    if ty.name()? == "Tensor" && ty.module()?.to_str()?.starts_with("torch") {
        let device = obj
            .getattr("device")?
            .getattr("type")?
            .extract::<String>()?;
        if device != "cpu" {
            return Err(PyTypeError::new_err(format!(
                "{what} must be a CPU tensor, got one on {device}"
            )));
        }
        let arr = obj.call_method0("detach")?.call_method0("numpy")?;
        return from_array(what, arr.downcast::<PyUntypedArray>()?);
    }
    let asarray = obj.py().import("numpy")?.getattr("asarray")?;
    match asarray.call1((obj,)) {
        Ok(arr) => match arr.downcast::<PyUntypedArray>() {
            Ok(a) if a.dtype().kind() != b'O' => from_array(what, a),
            _ => Err(PyTypeError::new_err(format!(
                "{what} must be a sequence of ints, got {}",
                ty.name()?
            ))),
        },
        Err(_) => Err(PyTypeError::new_err(format!(
            "{what} must be a sequence of ints, got {}",
            ty.name()?
        ))),
    }
}

/// A namespace from `None`, `str` (its utf-8 bytes), `bytes` or `bytearray` (its bytes).
pub fn namespace(obj: Option<&Bound<'_, PyAny>>) -> PyResult<Namespace> {
    let Some(obj) = obj.filter(|o| !o.is_none()) else {
        return Ok(None);
    };
    if let Ok(s) = obj.downcast::<PyString>() {
        return Ok(Some(s.to_str()?.as_bytes().into()));
    }
    if let Ok(b) = obj.downcast::<PyBytes>() {
        return Ok(Some(b.as_bytes().into()));
    }
    if let Ok(b) = obj.downcast::<PyByteArray>() {
        // Like bytes: its contents now.
        return Ok(Some(b.to_vec().into()));
    }
    Err(PyTypeError::new_err(format!(
        "namespace must be None, str, bytes or bytearray, got {}",
        obj.get_type().name()?
    )))
}

/// `obj` as a Python int when it is one or converts like one (`operator.index`: numpy integer
/// scalars, ...); `None` for anything else, `bool` included.
pub fn as_int<'py>(obj: &Bound<'py, PyAny>) -> Option<Bound<'py, PyInt>> {
    if obj.is_instance_of::<PyBool>() {
        return None;
    }
    if let Ok(i) = obj.downcast::<PyInt>() {
        return Some(i.clone());
    }
    let index = obj.py().import("operator").ok()?.getattr("index").ok()?;
    index.call1((obj,)).ok()?.downcast_into::<PyInt>().ok()
}

/// A count (`>= 0`) from a Python int or numpy integer, with errors that name the argument and
/// the value: a negative value, or one beyond 64 bits, is a `ValueError`; anything but an int
/// (`bool` included) a `TypeError`.
pub fn count(what: &str, obj: &Bound<'_, PyAny>) -> PyResult<usize> {
    if !obj.is_instance_of::<PyBool>() {
        if let Ok(v) = obj.extract::<u64>() {
            return Ok(usize::try_from(v).unwrap_or(usize::MAX));
        }
    }
    let Some(int) = as_int(obj) else {
        return Err(PyTypeError::new_err(format!(
            "{what} must be an int, got {}",
            obj.get_type().name()?
        )));
    };
    if let Ok(v) = int.extract::<u64>() {
        return Ok(usize::try_from(v).unwrap_or(usize::MAX));
    }
    let bound = if int.lt(0)? {
        "must be >= 0"
    } else {
        "must be below 2**64"
    };
    Err(PyValueError::new_err(format!("{what} {bound}, got {int}")))
}
