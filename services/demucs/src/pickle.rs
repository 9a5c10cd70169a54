//! A minimal, safe unpickler for `torch.save` files (pickle protocol 2–5 opcodes that
//! `torch.save` and Python's default pickler emit for plain data).
//!
//! Nothing is ever executed: `GLOBAL`/`STACK_GLOBAL` produce an opaque
//! [`Value::Global`], and `REDUCE`/`NEWOBJ`/`BUILD` produce [`Value::Object`] trees that
//! the caller interprets (`torch._utils._rebuild_tensor_v2`, `collections.OrderedDict`,
//! `fractions.Fraction`, ...). Persistent ids (`BINPERSID`, torch storages) become
//! [`Value::PersId`].
//!
//! Hostile input is bounded (found by fuzzing, `tests/fuzz_checkpoint.rs`): declared
//! lengths are checked against the data before anything is sliced, copies made by
//! `DUP` and memo gets may not add up to more than [`MAX_COPIED_NODES`] values (or 8
//! per input byte, whichever is more), which stops a few bytes that double a list
//! sixty times, and values may not nest deeper than [`MAX_DEPTH`], so dropping one
//! cannot overflow the stack.

use std::collections::HashMap;

use crate::error::DemucsError;

/// A decoded pickle value.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    /// `None`.
    None,
    /// `True` / `False`.
    Bool(bool),
    /// An integer that fits in 64 bits.
    Int(i64),
    /// A float.
    Float(f64),
    /// A `str`.
    Str(String),
    /// `bytes`.
    Bytes(Vec<u8>),
    /// A list.
    List(Vec<Value>),
    /// A tuple.
    Tuple(Vec<Value>),
    /// A dict (keys in insertion order).
    Dict(Vec<(Value, Value)>),
    /// A class or function reference (`module`, `name`), kept opaque.
    Global(String, String),
    /// The result of calling a global (`REDUCE`/`NEWOBJ`), with its `BUILD` state and
    /// any items set on it (`OrderedDict`).
    Object {
        /// What was called.
        callable: Box<Value>,
        /// The arguments.
        args: Box<Value>,
        /// `BUILD` state, if any.
        state: Option<Box<Value>>,
        /// Items added with `SETITEM(S)` (dict subclasses).
        items: Vec<(Value, Value)>,
    },
    /// A persistent id (torch storages).
    PersId(Box<Value>),
    /// The stack marker (never in a finished value).
    Mark,
}

impl Value {
    /// The string, when this is one.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }

    /// Dict items (a plain dict or a dict subclass such as `OrderedDict`).
    pub fn dict_items(&self) -> Option<&[(Value, Value)]> {
        match self {
            Value::Dict(items) => Some(items),
            Value::Object { items, .. } => Some(items),
            _ => None,
        }
    }

    /// Looks a string key up in a dict.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.dict_items()?.iter().find(|(k, _)| k.as_str() == Some(key)).map(|(_, v)| v)
    }
}

/// Most values copied by `DUP` and memo gets in one pickle (on top of 8 per byte).
pub const MAX_COPIED_NODES: usize = 1 << 20;

/// Deepest nesting of values (torch checkpoints nest a few levels).
pub const MAX_DEPTH: usize = 256;

/// Calls `f` on each value directly inside `v`.
fn each_child<'a>(v: &'a Value, f: &mut impl FnMut(&'a Value)) {
    match v {
        Value::List(xs) | Value::Tuple(xs) => xs.iter().for_each(f),
        Value::Dict(kv) => kv.iter().for_each(|(k, v)| {
            f(k);
            f(v)
        }),
        Value::Object { callable, args, state, items } => {
            f(callable);
            f(args);
            if let Some(s) = state {
                f(s);
            }
            items.iter().for_each(|(k, v)| {
                f(k);
                f(v)
            });
        }
        Value::PersId(x) => f(x),
        _ => {}
    }
}

/// Number of values in `v`, counting stops once past `limit`.
fn nodes(v: &Value, limit: usize) -> usize {
    let mut n = 0;
    let mut todo = vec![v];
    while let Some(v) = todo.pop() {
        n += 1;
        if n > limit {
            break;
        }
        each_child(v, &mut |c| todo.push(c));
    }
    n
}

/// Nesting depth of `v` (a scalar is 1), counting stops once past `limit`.
fn depth(v: &Value, limit: usize) -> usize {
    let mut max = 0;
    let mut todo = vec![(v, 1usize)];
    while let Some((v, d)) = todo.pop() {
        max = max.max(d);
        if d > limit {
            break;
        }
        each_child(v, &mut |c| todo.push((c, d + 1)));
    }
    max
}

/// Refuses a value that would nest deeper than [`MAX_DEPTH`] once put in a container.
fn shallow(v: Value) -> Result<Value, DemucsError> {
    if depth(&v, MAX_DEPTH) >= MAX_DEPTH {
        return Err(err(format!("values nested deeper than {MAX_DEPTH} levels")));
    }
    Ok(v)
}

fn err(msg: impl Into<String>) -> DemucsError {
    DemucsError::Pickle(msg.into())
}

struct Reader<'a> {
    data: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], DemucsError> {
        if n > self.data.len() - self.pos {
            return Err(err("unexpected end of pickle"));
        }
        let s = &self.data[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }
    fn u8(&mut self) -> Result<u8, DemucsError> {
        Ok(self.take(1)?[0])
    }
    fn u16(&mut self) -> Result<u16, DemucsError> {
        Ok(u16::from_le_bytes(self.take(2)?.try_into().unwrap()))
    }
    fn u32(&mut self) -> Result<u32, DemucsError> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().unwrap()))
    }
    fn u64(&mut self) -> Result<u64, DemucsError> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().unwrap()))
    }
    fn line(&mut self) -> Result<String, DemucsError> {
        let start = self.pos;
        while self.pos < self.data.len() && self.data[self.pos] != b'\n' {
            self.pos += 1;
        }
        let s = String::from_utf8_lossy(&self.data[start..self.pos]).into_owned();
        self.pos = (self.pos + 1).min(self.data.len());
        Ok(s)
    }
    fn utf8(&mut self, n: usize) -> Result<String, DemucsError> {
        String::from_utf8(self.take(n)?.to_vec()).map_err(|_| err("invalid utf-8 string"))
    }
}

/// Decodes one pickle.
pub fn unpickle(data: &[u8]) -> Result<Value, DemucsError> {
    let mut r = Reader { data, pos: 0 };
    let mut stack: Vec<Value> = Vec::new();
    let mut memo: HashMap<u32, Value> = HashMap::new();
    let mut copy_budget = MAX_COPIED_NODES.saturating_add(data.len().saturating_mul(8));
    // Charges a copy of `v` to the budget.
    let mut copied = |v: &Value| -> Result<(), DemucsError> {
        let n = nodes(v, copy_budget);
        if n > copy_budget {
            return Err(err("the pickle copies more values than it could hold (a pickle bomb?)"));
        }
        copy_budget -= n;
        Ok(())
    };

    /// Pops a value that is about to go into a container.
    fn pop(stack: &mut Vec<Value>) -> Result<Value, DemucsError> {
        shallow(stack.pop().ok_or_else(|| err("pickle stack underflow"))?)
    }
    fn pop_mark(stack: &mut Vec<Value>) -> Result<Vec<Value>, DemucsError> {
        let at = stack.iter().rposition(|v| matches!(v, Value::Mark)).ok_or_else(|| err("pickle mark not found"))?;
        let items = stack.split_off(at + 1);
        stack.pop();
        items.into_iter().map(shallow).collect()
    }
    fn top(stack: &mut [Value]) -> Result<&mut Value, DemucsError> {
        stack.last_mut().ok_or_else(|| err("pickle stack underflow"))
    }
    fn set_items(target: &mut Value, kv: Vec<Value>) -> Result<(), DemucsError> {
        let mut it = kv.into_iter();
        let items = match target {
            Value::Dict(items) => items,
            Value::Object { items, .. } => items,
            _ => return Err(err("SETITEM(S) on a non-dict")),
        };
        while let (Some(k), Some(v)) = (it.next(), it.next()) {
            items.push((k, v));
        }
        Ok(())
    }

    loop {
        let op = r.u8()?;
        match op {
            0x80 => {
                r.u8()?; // PROTO
            }
            0x95 => {
                r.u64()?; // FRAME
            }
            b'.' => return pop(&mut stack), // STOP
            b'(' => stack.push(Value::Mark),
            b'N' => stack.push(Value::None),
            0x88 => stack.push(Value::Bool(true)),
            0x89 => stack.push(Value::Bool(false)),
            b'J' => stack.push(Value::Int(r.u32()? as i32 as i64)),
            b'K' => stack.push(Value::Int(r.u8()? as i64)),
            b'M' => stack.push(Value::Int(r.u16()? as i64)),
            0x8a => {
                // LONG1
                let n = r.u8()? as usize;
                let b = r.take(n)?;
                if n > 8 {
                    return Err(err("integer wider than 64 bits"));
                }
                let mut v: i64 = 0;
                for (i, byte) in b.iter().enumerate() {
                    v |= (*byte as i64) << (8 * i);
                }
                if n > 0 && n < 8 && b[n - 1] & 0x80 != 0 {
                    v -= 1i64 << (8 * n);
                }
                stack.push(Value::Int(v));
            }
            b'G' => stack.push(Value::Float(f64::from_be_bytes(r.take(8)?.try_into().unwrap()))),
            b'I' => {
                let l = r.line()?;
                let v = match l.as_str() {
                    "00" => Value::Bool(false),
                    "01" => Value::Bool(true),
                    s => Value::Int(s.parse().map_err(|_| err("bad INT"))?),
                };
                stack.push(v);
            }
            0x8c => {
                let n = r.u8()? as usize;
                stack.push(Value::Str(r.utf8(n)?));
            }
            b'X' => {
                let n = r.u32()? as usize;
                stack.push(Value::Str(r.utf8(n)?));
            }
            0x8d => {
                let n = r.u64()? as usize;
                stack.push(Value::Str(r.utf8(n)?));
            }
            b'U' => {
                let n = r.u8()? as usize;
                stack.push(Value::Str(String::from_utf8_lossy(r.take(n)?).into_owned()));
            }
            b'T' => {
                let n = r.u32()? as usize;
                stack.push(Value::Str(String::from_utf8_lossy(r.take(n)?).into_owned()));
            }
            b'C' => {
                let n = r.u8()? as usize;
                stack.push(Value::Bytes(r.take(n)?.to_vec()));
            }
            b'B' => {
                let n = r.u32()? as usize;
                stack.push(Value::Bytes(r.take(n)?.to_vec()));
            }
            0x8e => {
                let n = r.u64()? as usize;
                stack.push(Value::Bytes(r.take(n)?.to_vec()));
            }
            b']' => stack.push(Value::List(Vec::new())),
            b'}' => stack.push(Value::Dict(Vec::new())),
            b')' => stack.push(Value::Tuple(Vec::new())),
            0x8f => stack.push(Value::List(Vec::new())), // EMPTY_SET, kept as a list
            b't' => {
                let items = pop_mark(&mut stack)?;
                stack.push(Value::Tuple(items));
            }
            0x85 => {
                let a = pop(&mut stack)?;
                stack.push(Value::Tuple(vec![a]));
            }
            0x86 => {
                let b = pop(&mut stack)?;
                let a = pop(&mut stack)?;
                stack.push(Value::Tuple(vec![a, b]));
            }
            0x87 => {
                let c = pop(&mut stack)?;
                let b = pop(&mut stack)?;
                let a = pop(&mut stack)?;
                stack.push(Value::Tuple(vec![a, b, c]));
            }
            b'l' => {
                let items = pop_mark(&mut stack)?;
                stack.push(Value::List(items));
            }
            b'd' => {
                let items = pop_mark(&mut stack)?;
                let mut d = Value::Dict(Vec::new());
                set_items(&mut d, items)?;
                stack.push(d);
            }
            0x91 => {
                let items = pop_mark(&mut stack)?; // FROZENSET
                stack.push(Value::List(items));
            }
            b'a' => {
                let v = pop(&mut stack)?;
                match top(&mut stack)? {
                    Value::List(l) => l.push(v),
                    _ => return Err(err("APPEND on a non-list")),
                }
            }
            b'e' | 0x90 => {
                // APPENDS / ADDITEMS
                let items = pop_mark(&mut stack)?;
                match top(&mut stack)? {
                    Value::List(l) => l.extend(items),
                    _ => return Err(err("APPENDS on a non-list")),
                }
            }
            b's' => {
                let v = pop(&mut stack)?;
                let k = pop(&mut stack)?;
                set_items(top(&mut stack)?, vec![k, v])?;
            }
            b'u' => {
                let items = pop_mark(&mut stack)?;
                set_items(top(&mut stack)?, items)?;
            }
            b'q' => {
                let i = r.u8()? as u32;
                let v = top(&mut stack)?;
                copied(v)?;
                memo.insert(i, v.clone());
            }
            b'r' => {
                let i = r.u32()?;
                let v = top(&mut stack)?;
                copied(v)?;
                memo.insert(i, v.clone());
            }
            0x94 => {
                let i = memo.len() as u32; // MEMOIZE
                let v = top(&mut stack)?;
                copied(v)?;
                memo.insert(i, v.clone());
            }
            b'p' => {
                let i: u32 = r.line()?.parse().map_err(|_| err("bad PUT"))?;
                let v = top(&mut stack)?;
                copied(v)?;
                memo.insert(i, v.clone());
            }
            b'h' | b'j' | b'g' => {
                let i = match op {
                    b'h' => r.u8()? as u32,
                    b'j' => r.u32()?,
                    _ => r.line()?.parse().map_err(|_| err("bad GET"))?,
                };
                let v = memo.get(&i).ok_or_else(|| err("memo miss"))?;
                copied(v)?;
                stack.push(v.clone());
            }
            b'c' => {
                let module = r.line()?;
                let name = r.line()?;
                stack.push(Value::Global(module, name));
            }
            0x93 => {
                let name = pop(&mut stack)?;
                let module = pop(&mut stack)?;
                match (module, name) {
                    (Value::Str(m), Value::Str(n)) => stack.push(Value::Global(m, n)),
                    _ => return Err(err("STACK_GLOBAL needs two strings")),
                }
            }
            b'R' | 0x81 => {
                // REDUCE / NEWOBJ
                let args = pop(&mut stack)?;
                let callable = pop(&mut stack)?;
                stack.push(Value::Object {
                    callable: Box::new(callable),
                    args: Box::new(args),
                    state: None,
                    items: Vec::new(),
                });
            }
            b'b' => {
                let st = pop(&mut stack)?;
                // BUILD on a plain value: the state is ignored.
                if let Value::Object { state, .. } = top(&mut stack)? {
                    *state = Some(Box::new(st));
                }
            }
            b'Q' => {
                let pid = pop(&mut stack)?;
                stack.push(Value::PersId(Box::new(pid)));
            }
            b'0' => {
                pop(&mut stack)?;
            }
            b'1' => {
                pop_mark(&mut stack)?;
            }
            b'2' => {
                let v = top(&mut stack)?;
                copied(v)?;
                let v = v.clone();
                stack.push(v);
            }
            other => return Err(err(format!("unsupported pickle opcode 0x{other:02x}"))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_values() {
        // pickle.dumps({'a': [1, -2, 3.5, 'x'], 'b': (True, None)}, protocol=2)
        let data = b"\x80\x02}q\x00(X\x01\x00\x00\x00aq\x01]q\x02(K\x01J\xfe\xff\xff\xffG@\x0c\x00\x00\x00\x00\x00\x00X\x01\x00\x00\x00xq\x03eX\x01\x00\x00\x00bq\x04\x88N\x86q\x05u.";
        let v = unpickle(data).unwrap();
        assert_eq!(
            v.get("a"),
            Some(&Value::List(vec![Value::Int(1), Value::Int(-2), Value::Float(3.5), Value::Str("x".into())]))
        );
        assert_eq!(v.get("b"), Some(&Value::Tuple(vec![Value::Bool(true), Value::None])));
    }

    #[test]
    fn huge_declared_lengths_are_errors() {
        // SHORT_BINUNICODE8 / BINBYTES8 with a length near 2^64.
        for data in [&b"\x8d\xff\xff\xff\xff\xff\xff\xff\xffabc."[..], b"\x8e\xfe\xff\xff\xff\xff\xff\xff\xffabc."] {
            assert!(matches!(unpickle(data), Err(DemucsError::Pickle(_))));
        }
    }

    #[test]
    fn copies_cannot_grow_exponentially() {
        // A list that appends a copy of itself (DUP, APPEND) doubles each time: 2^64
        // elements from 130 bytes, unless copies are bounded.
        let mut data = b"]".to_vec();
        data.extend(std::iter::repeat_n(*b"2a", 64).flatten());
        data.push(b'.');
        assert!(matches!(unpickle(&data), Err(DemucsError::Pickle(m)) if m.contains("copies")));
        // The same through the memo (PUT 0 / GET 0).
        let mut data = b"]q\x00".to_vec();
        data.extend(std::iter::repeat_n(*b"h\x00aq\x00", 64).flatten());
        data.push(b'.');
        assert!(matches!(unpickle(&data), Err(DemucsError::Pickle(m)) if m.contains("copies")));
    }

    #[test]
    fn nesting_is_bounded() {
        // A million nested lists would overflow the stack when dropped.
        let mut data = vec![b']'; 1_000_000];
        data.extend(vec![b'a'; 999_999]);
        data.push(b'.');
        assert!(matches!(unpickle(&data), Err(DemucsError::Pickle(m)) if m.contains("nested")));
    }
}
