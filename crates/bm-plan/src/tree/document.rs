//! The `bigmodel-module-tree/1` document (shared/spec/module-tree-v1.md):
//! read straight from its text into a [`ModuleTree`], and written.
//!
//! Reading takes two passes and no `serde_json::Value`. The first reads the
//! text once with `bm-json`'s pull reader into flat tables of
//! modules and tensors with borrowed names, and checks each object's keys
//! when the object ends (a module's name may come after its children, so
//! only then is its path known); the first thing wrong stops it. The second
//! feeds those tables to [`ModuleTreeBuilder`] in the order the tree has
//! always been built in, which checks names and ties. Every error names the
//! dotted path of the module or tensor and the byte, line and column of the
//! offending value. A document of a megabyte or more is read in two parts
//! on two threads, joined only when the join is exactly what one thread
//! would have read (see "Reading in two parts" below). The walk over
//! modules does not recurse; nesting is refused where serde_json refuses
//! it (128 levels of objects and lists, so a tree of 62 levels of
//! modules), and memory stays a small multiple of the document: what is
//! stored is only what was found valid, and the full dotted names, which
//! grow with depth, have a budget.

use std::borrow::Cow;
use std::fmt::Write as _;
use std::ops::Range;

use bm_tensor::{DType, TensorMeta};

use super::{
    DUPLICATE, FORMAT, ModuleId, ModuleTree, ModuleTreeBuilder, Node, PartKey, Structure, TensorId,
    TensorKind, join,
};
use crate::Error;
use bm_json::{Kind, Reader, line_column};

/// How much of a wrong value an error shows.
const SHOWN: usize = 40;

/// The bytes of full names a document may make per byte of its text. A
/// name repeats its ancestors' names, so a deep chain of short names would
/// otherwise make names quadratic in the document's size; real trees make
/// fewer bytes of names than they have of text.
const NAME_BYTES_PER_BYTE: usize = 32;

/// The shortest text of a child module and of a tensor that are valid.
const SHORTEST_MODULE: &str = r#"{"name":"a","class":""},"#;
const SHORTEST_TENSOR: &str = r#"{"name":"a","dtype":"I8","shape":[]},"#;
const SHORTEST_DIM: &str = "0,";

/// Why the first pass stopped.
enum Stop {
    /// The reader's message (with the byte offset).
    Syntax(String),
    Invalid(Error),
}

// Boxed: results move through every call of the first pass, and a large
// error type makes each of them a copy through the stack.
impl From<String> for Box<Stop> {
    fn from(e: String) -> Self {
        Box::new(Stop::Syntax(e))
    }
}

type Pass<T> = Result<T, Box<Stop>>;

/// A module-tree error at byte offset `pos` of `text`.
fn error_at(text: &str, path: impl Into<String>, reason: &str, pos: usize) -> Error {
    let (line, column) = line_column(text, pos);
    Error::tree(
        path,
        format!("{reason} at byte {pos} (line {line}, column {column})"),
    )
}

#[cold]
fn invalid(text: &str, path: impl Into<String>, reason: &str, pos: usize) -> Box<Stop> {
    Box::new(Stop::Invalid(error_at(text, path, reason, pos)))
}

/// Adds the position `pos` to a module-tree error of the builder.
fn locate(text: &str, error: Error, pos: usize) -> Error {
    match error {
        Error::Tree { path, reason } => error_at(text, path, &reason, pos),
        other => other,
    }
}

/// `root` for the root module's empty name.
fn display_path(name: &str) -> &str {
    if name.is_empty() { "root" } else { name }
}

// The tables of the first pass are compact (offsets and indices in 32
// bits), as they hold one entry per object of a document of megabytes:
// documents of 4 GiB or more are refused.

/// A string of the document: `len` bytes of its text from `start`, or, for
/// a string with escapes (`start == OWNED`), `RawDocument::owned[len]`.
#[derive(Clone, Copy, Debug)]
struct Str {
    start: u32,
    len: u32,
}

const OWNED: u32 = u32::MAX;

/// Entries `start..end` of `RawDocument::modules` or `RawDocument::tensors`.
#[derive(Clone, Copy, Debug)]
struct Span {
    start: u32,
    end: u32,
}

impl Span {
    fn at(start: usize) -> Span {
        Span {
            start: start as u32,
            end: start as u32,
        }
    }

    fn range(self) -> Range<usize> {
        self.start as usize..self.end as usize
    }
}

/// A module object, read and found complete.
struct RawModule {
    pos: u32,
    /// `NO_PARENT` for a root.
    parent: u32,
    name: Str,
    class: Str,
    /// Its tensors in `RawDocument::tensors`.
    params: Option<Span>,
    buffers: Option<Span>,
    /// The modules read inside its (last) `children` list.
    children: Option<Span>,
}

const NO_PARENT: u32 = u32::MAX;

/// A tensor object, read and found complete.
struct RawTensor {
    pos: u32,
    name: Str,
    dtype: DType,
    persistent: Option<bool>,
    /// Its dimensions in `RawDocument::dims`.
    shape: Span,
}

/// A group of `tied`.
struct RawTie {
    pos: u32,
    names: Vec<Str>,
}

/// The document as the first pass read it.
struct RawDocument<'a> {
    text: &'a str,
    /// Strings that had escapes.
    owned: Vec<String>,
    /// `None` when absent or not a string.
    format: Option<Str>,
    /// Index of the root in `modules`.
    root: Option<usize>,
    tied: Vec<RawTie>,
    /// Every module object read, each after its parent.
    modules: Vec<RawModule>,
    tensors: Vec<RawTensor>,
    /// The tensors' shapes, one after another: one table rather than a
    /// list per tensor, and nothing in the tables changes once read.
    dims: Vec<usize>,
}

impl<'a> RawDocument<'a> {
    /// Tables with room for as many modules, tensors and dimensions as
    /// `bytes` of the text could hold when each is written as short as a
    /// valid one can be: only the room used is ever touched, and growing
    /// these tables would copy them to fresh memory several times (fresh
    /// pages are a large part of the cost of reading a big tree).
    fn with_room(text: &'a str, bytes: usize) -> Self {
        RawDocument {
            text,
            owned: Vec::new(),
            format: None,
            root: None,
            tied: Vec::new(),
            modules: Vec::with_capacity(bytes / SHORTEST_MODULE.len()),
            tensors: Vec::with_capacity(bytes / SHORTEST_TENSOR.len()),
            dims: Vec::with_capacity(bytes / SHORTEST_DIM.len()),
        }
    }

    fn str(&self, s: Str) -> &str {
        if s.start == OWNED {
            &self.owned[s.len as usize]
        } else {
            &self.text[s.start as usize..(s.start + s.len) as usize]
        }
    }

    /// Keeps a string the reader read from `self.text`.
    #[inline(always)]
    fn keep(&mut self, s: Cow<'a, str>) -> Str {
        match s {
            Cow::Borrowed(b) => Str {
                start: (b.as_ptr() as usize - self.text.as_ptr() as usize) as u32,
                len: b.len() as u32,
            },
            Cow::Owned(o) => {
                self.owned.push(o);
                Str {
                    start: OWNED,
                    len: (self.owned.len() - 1) as u32,
                }
            }
        }
    }

    /// A string value kept, or `None` (after skipping it) for a value of
    /// another type.
    #[inline(always)]
    fn string(&mut self, r: &mut Reader<'a>) -> Pass<Option<Str>> {
        Ok(string(r)?.map(|s| self.keep(s)))
    }
}

/// Something wrong inside a module object, reported when the object ends
/// and its path is known.
struct Problem {
    pos: usize,
    reason: String,
    /// The tensor it is about, by its name in the module.
    tensor: Option<Str>,
}

impl ModuleTree {
    /// Parses a `bigmodel-module-tree/1` document. Errors name the offending
    /// module or tensor path and the line and column in `text`.
    pub fn from_json_str(text: &str) -> Result<ModuleTree, Error> {
        match read(text) {
            Ok(doc) => build(text, doc),
            Err(stop) => match *stop {
                Stop::Invalid(e) => Err(e),
                Stop::Syntax(e) => Err(Error::tree("", format!("not valid JSON: {e}"))),
            },
        }
    }

    /// Builds from a parsed `bigmodel-module-tree/1` document (positions in
    /// errors are those of its compact text).
    pub fn from_json(doc: &serde_json::Value) -> Result<ModuleTree, Error> {
        ModuleTree::from_json_str(&doc.to_string())
    }

    /// Whether `text` is a JSON object with both `format` and `root` keys,
    /// the sign of a module-tree document (other documents, such as a
    /// `config.json`, have neither). Reads only as far as needed: in a
    /// document written with `format` first, a few bytes.
    pub fn is_document(text: &str) -> bool {
        let mut r = Reader::new(text);
        let (mut format, mut root, mut first) = (false, false, true);
        if r.begin_object().is_err() {
            return false;
        }
        while let Ok(Some(key)) = r.next_key(first) {
            first = false;
            format |= key == "format";
            root |= key == "root";
            if format && root {
                return true;
            }
            if r.skip_value().is_err() {
                return false;
            }
        }
        false
    }
}

/// The first pass: the whole document's syntax, and the keys the format
/// knows, checked object by object. A large document is read in two parts
/// on two threads (see [`Handoff`]).
fn read(text: &str) -> Pass<RawDocument<'_>> {
    let two_threads = text.len() >= SPLIT_FROM
        && std::thread::available_parallelism().is_ok_and(|n| n.get() >= 2);
    match two_threads.then(|| split_point(text)).flatten() {
        Some(at) => read_split(text, at),
        None => read_from(text, None),
    }
}

/// [`read`] with the part from byte `at` read on a second thread.
fn read_split(text: &str, at: usize) -> Pass<RawDocument<'_>> {
    std::thread::scope(|scope| {
        let part = scope.spawn(move || read_part(text, at));
        read_from(
            text,
            Some(Handoff {
                at,
                part: Some(part),
            }),
        )
    })
}

fn read_from<'a>(text: &'a str, handoff: Option<Handoff<'a, '_>>) -> Pass<RawDocument<'a>> {
    let mut r = Reader::new(text);
    read_document(&mut r, text, handoff).map_err(|stop| match *stop {
        Stop::Syntax(e) => {
            let (line, column) = line_column(text, r.offset());
            Box::new(Stop::Syntax(format!("{e} (line {line}, column {column})")))
        }
        invalid => Box::new(invalid),
    })
}

fn read_document<'a>(
    r: &mut Reader<'a>,
    text: &'a str,
    mut handoff: Option<Handoff<'a, '_>>,
) -> Pass<RawDocument<'a>> {
    if text.len() >= u32::MAX as usize {
        return Err(Box::new(Stop::Invalid(Error::tree(
            "",
            "documents of 4 GiB or more are not read",
        ))));
    }
    if r.peek()? != Kind::Object {
        r.skip_value()?;
        r.end()?;
        return Err(Box::new(Stop::Invalid(Error::tree(
            "",
            "the document must be a JSON object",
        ))));
    }
    let mut doc = RawDocument::with_room(text, text.len());
    r.begin_object()?;
    let mut first = true;
    while let Some(key) = r.next_key(first)? {
        first = false;
        match &*key {
            "format" => doc.format = doc.string(r)?,
            "root" if r.peek()? == Kind::Object => {
                doc.root = Some(read_modules(r, &mut doc, handoff.as_mut())?);
            }
            "root" => return Err(invalid(text, "root", "must be an object", r.pos())),
            "tied" => doc.tied = read_tied(r, &mut doc)?,
            _ => r.skip_value()?,
        }
    }
    r.end()?;
    Ok(doc)
}

/// A string, or `None` (after skipping it) for a value of another type.
#[inline(always)]
fn string<'a>(r: &mut Reader<'a>) -> Pass<Option<Cow<'a, str>>> {
    if r.peek()? == Kind::String {
        Ok(Some(r.string()?))
    } else {
        r.skip_value()?;
        Ok(None)
    }
}

/// A module object being read.
struct Open {
    /// Its index in `RawDocument::modules`, or an [`ancestor`] of a part.
    module: usize,
    /// Its place in its parent's `children`, for paths while its name is
    /// not known yet.
    index: usize,
    first_key: bool,
    /// Inside its `children` list: whether no item came yet.
    first_child: Option<bool>,
    /// Items of its `children` list so far.
    children: usize,
    has_name: bool,
    name: Option<Str>,
    has_class: bool,
    class: Option<Str>,
    params: Option<Span>,
    buffers: Option<Span>,
    /// The modules read inside its (last) `children` list.
    list: Option<Span>,
    problem: Option<Box<Problem>>,
}

impl Open {
    fn new(module: usize, index: usize) -> Self {
        Open {
            module,
            index,
            first_key: true,
            first_child: None,
            children: 0,
            has_name: false,
            name: None,
            has_class: false,
            class: None,
            params: None,
            buffers: None,
            list: None,
            problem: None,
        }
    }

    /// Keeps the first problem.
    fn spoil(&mut self, problem: Box<Problem>) {
        self.problem.get_or_insert(problem);
    }

    /// Skips the value at the reader, wrong for `reason`, keeping the
    /// problem.
    fn skip_wrong(&mut self, r: &mut Reader<'_>, reason: &str) -> Pass<()> {
        let pos = r.pos();
        r.skip_value()?;
        self.spoil(Box::new(Problem {
            pos,
            reason: reason.into(),
            tensor: None,
        }));
        Ok(())
    }
}

/// The full name of the innermost open module (`""` for the root); a name
/// not read yet is written as the module's place in its parent's list.
fn full_name(doc: &RawDocument<'_>, open: &[Open]) -> String {
    let mut path = String::new();
    for module in open.iter().skip(1) {
        if !path.is_empty() {
            path.push('.');
        }
        match module.name {
            Some(name) => path.push_str(doc.str(name)),
            None => {
                let _ = write!(path, "children[{}]", module.index);
            }
        }
    }
    path
}

/// Reads the module object at the reader and all modules below it, without
/// recursion: `open` holds the modules whose objects are being read. With a
/// `handoff`, the part after its byte is taken from the second thread.
fn read_modules<'a>(
    r: &mut Reader<'a>,
    doc: &mut RawDocument<'a>,
    mut handoff: Option<&mut Handoff<'a, '_>>,
) -> Pass<usize> {
    let root = doc.modules.len();
    doc.modules.push(RawModule::new(r.pos(), NO_PARENT));
    r.begin_object()?;
    let mut open = vec![Open::new(root, 0)];
    let at = handoff.as_ref().map_or(usize::MAX, |h| h.at);
    while !open.is_empty() {
        // Closed by the splice, or read on here.
        if r.offset() == at
            && let Some(handoff) = handoff.take()
            && let Some(part) = handoff.take_part(&open)
            && splice(r, doc, &mut open, part)?
        {
            #[cfg(test)]
            tests::SPLICED.with(|n| n.set(n.get() + 1));
            break;
        }
        if let Some(done) = read_step(r, doc, &mut open)? {
            close_module(doc, &open, done)?;
        }
    }
    Ok(root)
}

/// Reads the next key, list item or end of the innermost open module; the
/// module that ended, if one did.
#[inline(always)]
fn read_step<'a>(
    r: &mut Reader<'a>,
    doc: &mut RawDocument<'a>,
    open: &mut Vec<Open>,
) -> Pass<Option<Open>> {
    let Some(top) = open.last_mut() else {
        return Ok(None);
    };
    let m = top.module;
    if let Some(first_child) = top.first_child {
        top.first_child = Some(false);
        if !r.next_element(first_child)? {
            top.first_child = None;
            let end = doc.modules.len();
            if let Some(span) = &mut top.list {
                span.end = end as u32;
            }
        } else if r.peek()? == Kind::Object {
            let index = top.children;
            top.children += 1;
            let child = doc.modules.len();
            doc.modules.push(RawModule::new(r.pos(), m as u32));
            r.begin_object()?;
            open.push(Open::new(child, index));
        } else {
            top.children += 1;
            top.skip_wrong(r, "each child must be an object")?;
        }
        return Ok(None);
    }
    let first_key = std::mem::replace(&mut top.first_key, false);
    let key = match plain_module_key(r, first_key) {
        Some(key) => Cow::Borrowed(key),
        None => match r.next_key(first_key)? {
            Some(key) => key,
            None => return Ok(open.pop()),
        },
    };
    match &*key {
        "name" => {
            top.has_name = true;
            top.name = doc.string(r)?;
        }
        "class" => {
            top.has_class = true;
            top.class = doc.string(r)?;
        }
        "params" | "buffers" => match read_tensors(r, doc, &key)? {
            Ok(range) if key == "params" => top.params = Some(range),
            Ok(range) => top.buffers = Some(range),
            Err(problem) => top.spoil(problem),
        },
        "children" if r.peek()? == Kind::Array => {
            r.begin_array()?;
            top.list = Some(Span::at(doc.modules.len()));
            top.first_child = Some(true);
            top.children = 0;
        }
        "children" => top.skip_wrong(r, "\"children\" must be a list")?,
        _ => r.skip_value()?,
    }
    Ok(None)
}

/// The next key of a module object when it is one the format knows,
/// written plainly (no escape): the reader is then past its `:`. `None`,
/// with the reader where it was, for anything else, which
/// [`Reader::next_key`] then reads.
#[inline(always)]
fn plain_module_key(r: &mut Reader<'_>, first: bool) -> Option<&'static str> {
    let saved = r.clone();
    if first || r.take(b",") {
        let key = if r.take(b"\"name\"") {
            Some("name")
        } else if r.take(b"\"class\"") {
            Some("class")
        } else if r.take(b"\"params\"") {
            Some("params")
        } else if r.take(b"\"children\"") {
            Some("children")
        } else if r.take(b"\"buffers\"") {
            Some("buffers")
        } else {
            None
        };
        if key.is_some() && r.take(b":") {
            return key;
        }
    }
    *r = saved;
    None
}

impl RawModule {
    fn new(pos: usize, parent: u32) -> Self {
        let empty = Str { start: 0, len: 0 };
        RawModule {
            pos: pos as u32,
            parent,
            name: empty,
            class: empty,
            params: None,
            buffers: None,
            children: None,
        }
    }
}

/// Checks a module object that ended (`open` holds its ancestors) and keeps
/// what was read of it. Paths are made only for errors: making them for
/// every module would cost the depth of the tree each time.
fn close_module(doc: &mut RawDocument<'_>, open: &[Open], done: Open) -> Pass<()> {
    let text = doc.text;
    let pos = doc.modules[done.module].pos as usize;
    let name = if open.is_empty() {
        if done.has_name {
            return Err(invalid(
                text,
                "root",
                "the root module has no \"name\"",
                pos,
            ));
        }
        Str { start: 0, len: 0 }
    } else {
        match done.name {
            Some(name) => name,
            None => {
                return Err(invalid(
                    text,
                    display_path(&full_name(doc, open)),
                    "a child module has no \"name\" string",
                    pos,
                ));
            }
        }
    };
    let path = || join(&full_name(doc, open), doc.str(name));
    let Some(class) = done.class else {
        return Err(invalid(
            text,
            display_path(&path()),
            "missing \"class\" string",
            pos,
        ));
    };
    if let Some(p) = done.problem {
        let at = match p.tensor {
            Some(tensor) => join(&path(), doc.str(tensor)),
            None => display_path(&path()).to_string(),
        };
        return Err(invalid(text, at, &p.reason, p.pos));
    }
    let module = &mut doc.modules[done.module];
    module.name = name;
    module.class = class;
    module.params = done.params;
    module.buffers = done.buffers;
    module.children = done.list;
    Ok(())
}

// Reading in two parts. A second thread reads from a place near the middle
// where a `children` list has another module: it knows neither how deep
// that is nor what encloses it, so it reads the modules that follow, and
// whenever a module list ends inside something it did not see begin, takes
// it for the enclosing module's list and keeps what follows of that module
// (an *ancestor*), until it has closed the one at the top, the root. The
// first thread reads from the start; only if it comes to that very place
// between two modules of a list, with as many modules open as the second
// closed, and the second found nothing wrong, are the parts joined: the
// second's modules and tensors follow the first's, and each open module
// takes what the second read of it, in the order one thread would have
// (keys read later replace earlier ones), before it is checked. Anything
// else (an error, a `children` key on an ancestor, another shape of
// document) and the first thread reads on alone, so what is accepted and
// every error are the same as reading on one thread.

/// Documents this long or longer are read on two threads.
const SPLIT_FROM: usize = 1 << 20;

/// How far past the middle a place to split is looked for.
const SPLIT_SEARCH: usize = 1 << 16;

/// The place to split `text` at: just after the `}` of a module object
/// followed by another one in the same list (`}`, `,`, `{` and a `"name"`
/// or `"class"` key, with any white space between), past its middle.
fn split_point(text: &str) -> Option<usize> {
    let bytes = text.as_bytes();
    let from = text.len() / 2;
    let until = (from + SPLIT_SEARCH).min(bytes.len());
    let ws = |i| after_ws(bytes, i);
    (from..until)
        .find(|&i| {
            if bytes[i] != b'}' {
                return false;
            }
            let comma = ws(i + 1);
            if bytes.get(comma) != Some(&b',') {
                return false;
            }
            let brace = ws(comma + 1);
            if bytes.get(brace) != Some(&b'{') {
                return false;
            }
            // A module, not a tensor (which has a name but no class): a module
            // written name first has its class before any `}`.
            let object = &bytes[ws(brace + 1)..];
            let head = &object[..object.len().min(256)];
            let class = head.windows(7).position(|w| w == b"\"class\"");
            let end = head.iter().position(|&b| b == b'}');
            object.starts_with(b"\"class\"")
                || (object.starts_with(b"\"name\"")
                    && class.is_some_and(|c| end.is_none_or(|e| c < e)))
        })
        .map(|i| i + 1)
}

/// The first byte at or after `i` that is not white space.
fn after_ws(bytes: &[u8], mut i: usize) -> usize {
    while let Some(b' ' | b'\t' | b'\n' | b'\r') = bytes.get(i) {
        i += 1;
    }
    i
}

/// The id an ancestor of a part is given in place of a module index:
/// `level` 0 is the module whose list the part starts in.
fn ancestor(level: usize) -> usize {
    ANCESTORS - level
}

/// Ancestors are counted down from here; no module index comes near (a
/// document has fewer than 2^32 / 24 modules).
const ANCESTORS: usize = u32::MAX as usize - 1;

/// What the second thread read.
struct Part<'a> {
    modules: Vec<RawModule>,
    tensors: Vec<RawTensor>,
    dims: Vec<usize>,
    owned: Vec<String>,
    /// What it read of each ancestor after the place, innermost first.
    ancestors: Vec<Open>,
    /// Where it stopped: after the root's `}`.
    reader: Reader<'a>,
}

/// The first thread's side of a split: the place and the second thread.
struct Handoff<'a, 'scope> {
    at: usize,
    part: Option<std::thread::ScopedJoinHandle<'scope, Option<Part<'a>>>>,
}

impl<'a> Handoff<'a, '_> {
    /// The part, when the first thread is at the place between two modules
    /// of a list and the second read what it needs to.
    fn take_part(&mut self, open: &[Open]) -> Option<Part<'a>> {
        let at_item = open.last()?.first_child == Some(false);
        let part = match self.part.take()?.join() {
            Ok(part) => part?,
            Err(panic) => std::panic::resume_unwind(panic),
        };
        (at_item && part.ancestors.len() == open.len()).then_some(part)
    }
}

/// Reads the part of `text` from `at` (just after a module object in a
/// `children` list) up to the end of the root module: `None` when it is
/// anything else or has anything wrong.
fn read_part(text: &str, at: usize) -> Option<Part<'_>> {
    let mut r = Reader::part(text, at);
    let mut doc = RawDocument::with_room(text, text.len() - at);
    let in_list = |level: usize| {
        let mut open = Open::new(ancestor(level), 0);
        open.first_key = false;
        open.first_child = Some(false);
        open.list = Some(Span {
            start: BEFORE_PART,
            end: BEFORE_PART,
        });
        open
    };
    let mut ancestors = Vec::new();
    let mut open = vec![in_list(0)];
    loop {
        let Some(done) = read_step(&mut r, &mut doc, &mut open).ok()? else {
            continue;
        };
        if !open.is_empty() {
            close_module(&mut doc, &open, done).ok()?;
            continue;
        }
        // An ancestor ended: with nothing wrong and its list the one the
        // part started in (a second `children` would replace it).
        if done.problem.is_some() || done.list.is_none_or(|l| l.start != BEFORE_PART) {
            return None;
        }
        ancestors.push(done);
        if ancestors.len() > MAX_LEVELS {
            return None;
        }
        // In its parent's list, another module or the list's end follows;
        // after the root, another key of the document or its end.
        let next = r.pos();
        let bytes = text.as_bytes();
        let in_parent_list = match bytes.get(next) {
            Some(b']') => true,
            Some(b',') => bytes.get(after_ws(bytes, next + 1)) == Some(&b'{'),
            _ => false,
        };
        if !in_parent_list {
            break;
        }
        open.push(in_list(ancestors.len()));
    }
    Some(Part {
        modules: doc.modules,
        tensors: doc.tensors,
        dims: doc.dims,
        owned: doc.owned,
        ancestors,
        reader: r,
    })
}

/// The start of an ancestor's list, which is before the part.
const BEFORE_PART: u32 = u32::MAX;

/// Modules nest at most this deep (two levels of JSON each).
const MAX_LEVELS: usize = 64;

/// Joins `part` to what the first thread read (`open` holds its modules
/// open at the place): appends the part's tables, then closes each open
/// module, innermost first, with what the part read of it.
fn splice<'a>(
    r: &mut Reader<'a>,
    doc: &mut RawDocument<'a>,
    open: &mut Vec<Open>,
    part: Part<'a>,
) -> Pass<bool> {
    if !r.join(&part.reader) {
        return Ok(false);
    }
    let (modules, tensors, owned) = (doc.modules.len(), doc.tensors.len(), doc.owned.len());
    let dims = doc.dims.len();
    let string = |s: Str| match s.start {
        OWNED => Str {
            start: OWNED,
            len: s.len + owned as u32,
        },
        _ => s,
    };
    let shift = |span: Span, by: usize| Span {
        start: span.start + by as u32,
        end: span.end + by as u32,
    };
    doc.owned.extend(part.owned);
    doc.dims.extend_from_slice(&part.dims);
    doc.tensors
        .extend(part.tensors.into_iter().map(|t| RawTensor {
            name: string(t.name),
            shape: shift(t.shape, dims),
            ..t
        }));
    let parent_of = |p: u32, open: &[Open]| -> u32 {
        let p = p as usize;
        if p > ANCESTORS - MAX_LEVELS - 1 {
            open[open.len() - 1 - (ANCESTORS - p)].module as u32
        } else {
            (p + modules) as u32
        }
    };
    doc.modules
        .extend(part.modules.into_iter().map(|m| RawModule {
            pos: m.pos,
            parent: parent_of(m.parent, open),
            name: string(m.name),
            class: string(m.class),
            params: m.params.map(|s| shift(s, tensors)),
            buffers: m.buffers.map(|s| shift(s, tensors)),
            children: m.children.map(|s| shift(s, modules)),
        }));
    for later in part.ancestors {
        let Some(mut done) = open.pop() else {
            unreachable!("as many ancestors as open modules");
        };
        if later.has_name {
            done.has_name = true;
            done.name = later.name.map(string);
        }
        if later.has_class {
            done.has_class = true;
            done.class = later.class.map(string);
        }
        if let Some(params) = later.params {
            done.params = Some(shift(params, tensors));
        }
        if let Some(buffers) = later.buffers {
            done.buffers = Some(shift(buffers, tensors));
        }
        if let (Some(list), Some(end)) = (&mut done.list, later.list) {
            list.end = end.end + modules as u32;
        }
        close_module(doc, open, done)?;
    }
    Ok(true)
}

/// Reads a `params` or `buffers` list into `tensors`: the range it added,
/// or the first problem.
fn read_tensors<'a>(
    r: &mut Reader<'a>,
    doc: &mut RawDocument<'a>,
    key: &str,
) -> Pass<Result<Span, Box<Problem>>> {
    let pos = r.pos();
    if r.peek()? != Kind::Array {
        r.skip_value()?;
        return Ok(Err(Box::new(Problem {
            pos,
            reason: format!("\"{key}\" must be a list"),
            tensor: None,
        })));
    }
    r.begin_array()?;
    let start = doc.tensors.len();
    let mut problem = None;
    let mut first = true;
    while r.next_element(first)? {
        first = false;
        if read_plain_tensor(r, doc, key) {
            continue;
        }
        let pos = r.pos();
        let found = if r.peek()? == Kind::Object {
            read_tensor(r, doc, key)?
        } else {
            r.skip_value()?;
            Some(Box::new(Problem {
                pos,
                reason: format!("each entry of \"{key}\" must be an object"),
                tensor: None,
            }))
        };
        if let Some(p) = found {
            problem.get_or_insert(p);
        }
    }
    Ok(match problem {
        None => Ok(Span {
            start: start as u32,
            end: doc.tensors.len() as u32,
        }),
        Some(p) => Err(p),
    })
}

/// Reads a tensor object laid out as bigmodel and `tools/export_module_tree.py`
/// write one, `{"name": N, "shape": [D, ...], "dtype": T}` (then
/// `"persistent": B` in a buffer), with no escape and nothing wrong in it,
/// into `doc.tensors` with the reader's plain tokens: the general path
/// dispatches on every key and checks every value's kind, a large part of
/// reading a big tree, most of whose objects are tensors. False, with the
/// reader and `doc` as they were, for anything else, which [`read_tensor`]
/// then reads.
#[inline(always)]
fn read_plain_tensor<'a>(r: &mut Reader<'a>, doc: &mut RawDocument<'a>, key: &str) -> bool {
    #[cfg(test)]
    if !tests::PLAIN.with(std::cell::Cell::get) {
        return false;
    }
    let saved = r.clone();
    let dims = doc.dims.len();
    match plain_tensor(r, doc, key) {
        Some(tensor) => {
            doc.tensors.push(tensor);
            true
        }
        None => {
            *r = saved;
            doc.dims.truncate(dims);
            false
        }
    }
}

#[inline(always)]
fn plain_tensor<'a>(r: &mut Reader<'a>, doc: &mut RawDocument<'a>, key: &str) -> Option<RawTensor> {
    let pos = r.pos();
    // The object and its shape's list, two levels down.
    if !(r.passed_nested(2) && r.take(b"{") && r.take(b"\"name\"") && r.take(b":")) {
        return None;
    }
    let name = doc.keep(Cow::Borrowed(r.plain_string()?));
    if !(r.take(b",") && r.take(b"\"shape\"") && r.take(b":") && r.take(b"[")) {
        return None;
    }
    let start = doc.dims.len();
    if !r.take(b"]") {
        loop {
            doc.dims.push(usize::try_from(r.plain_u64()?).ok()?);
            if r.take(b"]") {
                break;
            }
            if !r.take(b",") {
                return None;
            }
        }
    }
    let shape = Span {
        start: start as u32,
        end: doc.dims.len() as u32,
    };
    if !(r.take(b",") && r.take(b"\"dtype\"") && r.take(b":")) {
        return None;
    }
    let dtype = DType::from_safetensors_str(r.plain_string()?)?;
    let persistent = if key == "buffers" && r.take(b",") {
        if !(r.take(b"\"persistent\"") && r.take(b":")) {
            return None;
        }
        match (r.take(b"true"), r.take(b"false")) {
            (true, _) => Some(true),
            (_, true) => Some(false),
            _ => return None,
        }
    } else {
        None
    };
    if !r.take(b"}") {
        return None;
    }
    #[cfg(test)]
    tests::PLAIN_READ.with(|n| n.set(n.get() + 1));
    Some(RawTensor {
        pos: pos as u32,
        name,
        dtype,
        persistent,
        shape,
    })
}

/// Reads one tensor object of a `key` list into `doc.tensors`, or says
/// what is wrong with it. (Tensors read after a problem are kept but never
/// used: any problem stops the document.) Results stay small: they are
/// returned once per tensor.
fn read_tensor<'a>(
    r: &mut Reader<'a>,
    doc: &mut RawDocument<'a>,
    key: &str,
) -> Pass<Option<Box<Problem>>> {
    let pos = r.pos();
    let (mut name, mut dtype, mut shape, mut persistent) = (None, None, None, None);
    // The first wrong value; its tensor's name may come after it.
    let mut wrong: Option<Box<(usize, String)>> = None;
    r.begin_object()?;
    let mut first = true;
    while let Some(field) = r.next_key(first)? {
        first = false;
        let value_pos = r.pos();
        match &*field {
            "name" => name = doc.string(r)?,
            "dtype" => {
                dtype = None;
                if let Some(text) = string(r)? {
                    dtype = DType::from_safetensors_str(&text);
                    if dtype.is_none() {
                        wrong.get_or_insert_with(|| Box::new((
                            value_pos,
                            format!(
                                "unknown dtype {text:?} (expected F64 F32 F16 BF16 I64 I32 I16 I8 U8 BOOL F8_E4M3 F8_E5M2)"
                            ),
                        )));
                    }
                }
            }
            "shape" if r.peek()? == Kind::Array => {
                if let Some(problem) = read_shape(r, doc, &mut shape)? {
                    wrong.get_or_insert(problem);
                }
            }
            "shape" => {
                r.skip_value()?;
                shape = None;
            }
            "persistent" => {
                let saved = r.clone();
                let value = match r.peek()? {
                    Kind::Literal => r.bool()?,
                    _ => {
                        r.skip_value()?;
                        None
                    }
                };
                match value {
                    Some(b) => persistent = Some(b),
                    None => {
                        let found = saved.clone().skip_and_show(SHOWN)?;
                        wrong.get_or_insert_with(|| {
                            Box::new((
                                value_pos,
                                format!("\"persistent\" must be true or false, found {found}"),
                            ))
                        });
                    }
                }
            }
            _ => r.skip_value()?,
        }
    }
    let Some(name) = name else {
        return Ok(Some(Box::new(Problem {
            pos,
            reason: format!("an entry of \"{key}\" has no \"name\" string"),
            tensor: None,
        })));
    };
    let problem = |pos: usize, reason: String| {
        Some(Box::new(Problem {
            pos,
            reason,
            tensor: Some(name),
        }))
    };
    if let Some(wrong) = wrong {
        let (pos, reason) = *wrong;
        return Ok(problem(pos, reason));
    }
    let Some(dtype) = dtype else {
        return Ok(problem(pos, "missing \"dtype\" string".into()));
    };
    let Some(shape) = shape else {
        return Ok(problem(pos, "missing \"shape\" list".into()));
    };
    if key == "params" && persistent.is_some() {
        return Ok(problem(
            pos,
            "\"persistent\" applies to buffers only".into(),
        ));
    }
    doc.tensors.push(RawTensor {
        pos: pos as u32,
        name,
        dtype,
        shape,
        persistent,
    });
    Ok(None)
}

/// Reads a `shape` list into `dims`, and its place there into `shape`, or
/// says where its first bad dimension is and why (and leaves `shape` as it
/// was).
fn read_shape(
    r: &mut Reader<'_>,
    doc: &mut RawDocument<'_>,
    shape: &mut Option<Span>,
) -> Pass<Option<Box<(usize, String)>>> {
    r.begin_array()?;
    let start = doc.dims.len();
    let mut wrong = None;
    let mut first = true;
    while r.next_element(first)? {
        first = false;
        let pos = r.pos();
        // A plain integer: no sign, fraction or exponent.
        let dim = match r.peek()? {
            Kind::Number => r.number()?.and_then(|d| usize::try_from(d).ok()),
            _ => {
                r.skip_value()?;
                None
            }
        };
        match dim {
            Some(d) => doc.dims.push(d),
            None if wrong.is_none() => {
                // The value just read, as `skip_and_show` shows it.
                let text = bm_json::shorten(&doc.text[pos..r.offset()], SHOWN);
                wrong = Some(Box::new((
                    pos,
                    format!("shape dimension {text} is not a non-negative integer"),
                )));
            }
            None => {}
        }
    }
    if wrong.is_some() {
        doc.dims.truncate(start);
    } else {
        *shape = Some(Span {
            start: start as u32,
            end: doc.dims.len() as u32,
        });
    }
    Ok(wrong)
}

fn read_tied<'a>(r: &mut Reader<'a>, doc: &mut RawDocument<'a>) -> Pass<Vec<RawTie>> {
    let text = doc.text;
    if r.peek()? != Kind::Array {
        return Err(invalid(text, "tied", "must be a list of lists", r.pos()));
    }
    r.begin_array()?;
    let mut groups = Vec::new();
    let mut first = true;
    while r.next_element(first)? {
        first = false;
        let pos = r.pos();
        let path = || format!("tied[{}]", groups.len());
        if r.peek()? != Kind::Array {
            return Err(invalid(text, path(), "must be a list of names", pos));
        }
        r.begin_array()?;
        let mut names = Vec::new();
        let mut first_name = true;
        while r.next_element(first_name)? {
            first_name = false;
            let name_pos = r.pos();
            match doc.string(r)? {
                Some(name) => names.push(name),
                None => return Err(invalid(text, path(), "names must be strings", name_pos)),
            }
        }
        groups.push(RawTie {
            pos: pos as u32,
            names,
        });
    }
    Ok(groups)
}

/// The second pass: the tree, built in the order it has always been built
/// in (a module's params, buffers, then all its children, then each child's
/// own, depth first), so module and tensor ids do not depend on how the
/// document was written. The builder checks names and ties.
fn build(text: &str, mut doc: RawDocument<'_>) -> Result<ModuleTree, Error> {
    match doc.format.map(|f| doc.str(f)) {
        Some(FORMAT) => {}
        Some(other) => {
            return Err(Error::tree(
                "format",
                format!("unknown format {other:?}, expected {FORMAT:?}"),
            ));
        }
        None => {
            return Err(Error::tree(
                "format",
                format!("missing \"format\": {FORMAT:?}"),
            ));
        }
    }
    let Some(root) = doc.root else {
        return Err(Error::tree("root", "missing"));
    };
    let mut builder = ModuleTreeBuilder::new(doc.str(doc.modules[root].class));
    builder.siblings_checked_by_caller();
    // Names are mostly shorter than the text that holds them.
    builder.reserve(doc.modules.len(), doc.tensors.len(), text.len());
    // The first name taken twice, found as a module's siblings are added:
    // reported once every other check of the build has passed, as one
    // index of all names made after the build found it (so the error is
    // the same whatever the build meets after it).
    let mut duplicate: Option<(Node, u32)> = None;
    let mut siblings = Siblings::default();
    let lists = children_lists(&doc.modules);
    let name_budget = text.len().saturating_mul(NAME_BYTES_PER_BYTE);
    // Checked after each node is added: its full name is the last in the
    // builder's names, and all of them are one buffer.
    let spend = |builder: &ModuleTreeBuilder, node: Node, pos: u32| {
        if builder.name_bytes() > name_budget {
            return Err(error_at(
                text,
                builder.node_name(node),
                &format!(
                    "the full names of the modules and tensors pass {name_budget} bytes, \
                     {NAME_BYTES_PER_BYTE} times the size of the document: the tree nests too deep"
                ),
                pos as usize,
            ));
        }
        Ok(())
    };

    // The links and orders of the tree, made as it is built, in the order
    // `Structure::of` would find them: modules are added in pre-order, each
    // one's children at once, and its params and buffers each in one run.
    // Sized for every module read; only those reached get an id.
    let most = doc.modules.len();
    let mut structure = Structure {
        starts: vec![0; most],
        links: Vec::with_capacity(most + doc.tensors.len()),
        preorder: Vec::with_capacity(most),
        preorder_pos: vec![0; most],
        subtree_end: vec![0; most],
    };
    // (raw module, its id in the builder), or (CLOSE, id) once the
    // modules below it are all added.
    const CLOSE: usize = usize::MAX;
    let mut stack: Vec<(usize, ModuleId)> = vec![(root, 0)];
    while let Some((raw, id)) = stack.pop() {
        if raw == CLOSE {
            structure.subtree_end[id] = structure.preorder.len();
            continue;
        }
        structure.preorder_pos[id] = structure.preorder.len();
        structure.preorder.push(id);
        let first_tensor = builder.tensor_count();
        let module = &doc.modules[raw];
        siblings.clear();
        for (list, param) in [(module.params, true), (module.buffers, false)] {
            for t in list.map_or(0..0, Span::range) {
                let t = &doc.tensors[t];
                let meta = TensorMeta::new(t.dtype, &doc.dims[t.shape.range()]);
                let name = doc.str(t.name);
                let added = if param {
                    builder.add_param(id, name, meta)
                } else {
                    builder.add_buffer(id, name, meta, t.persistent.unwrap_or(true))
                };
                let tensor = added.map_err(|e| locate(text, e, t.pos as usize))?;
                spend(&builder, Node::Tensor(tensor), t.pos)?;
                siblings.push(name, Node::Tensor(tensor), t.pos);
            }
        }
        let kids = lists.of(raw);
        let mut first_id = None;
        for &c in kids {
            let child = &doc.modules[c];
            let name = doc.str(child.name);
            let cid = builder
                .add_module(id, name, doc.str(child.class))
                .map_err(|e| locate(text, e, child.pos as usize))?;
            spend(&builder, Node::Module(cid), child.pos)?;
            siblings.push(name, Node::Module(cid), child.pos);
            first_id.get_or_insert(cid);
        }
        if duplicate.is_none() {
            duplicate = siblings.first_taken_twice();
        }
        // Its children, then its params and buffers (added in that order).
        structure.starts[id] = structure.links.len() as u32;
        let children = first_id.map_or(0..0, |first| first..first + kids.len());
        structure.links.extend(children);
        structure.links.extend(first_tensor..builder.tensor_count());
        stack.push((CLOSE, id));
        // The children got consecutive ids; the first is read first.
        if let Some(first_id) = first_id {
            for (k, &c) in kids.iter().enumerate().rev() {
                stack.push((c, first_id + k));
            }
        }
    }
    let modules = structure.preorder.len();
    structure.starts.truncate(modules);
    structure.preorder_pos.truncate(modules);
    structure.subtree_end.truncate(modules);
    // The first pass's tables are read; freed now, their memory holds the
    // index and the orders instead of fresh pages.
    drop(lists);
    doc.modules = Vec::new();
    doc.tensors = Vec::new();
    doc.dims = Vec::new();

    for group in &doc.tied {
        let names: Vec<&str> = group.names.iter().map(|n| doc.str(*n)).collect();
        builder.tie(&names);
    }
    if let Some((node, pos)) = duplicate {
        let name = builder.node_name(node);
        return Err(locate(text, Error::tree(name, DUPLICATE), pos as usize));
    }
    builder.finish_with(structure).map_err(|e| {
        // The builder names a bad group `tied[g]`; point at it.
        let group = match &e {
            Error::Tree { path, .. } => path
                .strip_prefix("tied[")
                .and_then(|rest| rest.strip_suffix(']'))
                .and_then(|g| g.parse::<usize>().ok())
                .and_then(|g| doc.tied.get(g)),
            _ => None,
        };
        match group {
            Some(group) => locate(text, e, group.pos as usize),
            None => e,
        }
    })
}

/// The names of one module's params, buffers and children, in the order
/// they were added.
#[derive(Default)]
struct Siblings<'d> {
    /// (name, node, its place in the text)
    added: Vec<(&'d str, Node, u32)>,
    /// For a module with many: each name's key and place in `added`.
    order: Vec<(PartKey, usize)>,
}

/// A module with this many siblings or fewer is checked pair by pair.
const FEW_SIBLINGS: usize = 16;

impl<'d> Siblings<'d> {
    fn clear(&mut self) {
        self.added.clear();
    }

    fn push(&mut self, name: &'d str, node: Node, pos: u32) {
        self.added.push((name, node, pos));
    }

    /// The first added whose name an earlier one has, where adding the
    /// names one at a time to an index would have stopped.
    fn first_taken_twice(&mut self) -> Option<(Node, u32)> {
        let added = &self.added;
        let first = if added.len() <= FEW_SIBLINGS {
            (1..added.len()).find(|&i| added[..i].iter().any(|a| a.0 == added[i].0))?
        } else {
            // Sorted by name, each name's places in the order added: the
            // second of a run is the first repeat of that name.
            self.order.clear();
            let keyed = added.iter().enumerate().map(|(i, a)| (PartKey::of(a.0), i));
            self.order.extend(keyed);
            self.order.sort_unstable_by(|a, b| {
                (a.0.cmp(&b.0))
                    .then_with(|| added[a.1].0.cmp(added[b.1].0))
                    .then(a.1.cmp(&b.1))
            });
            self.order
                .windows(2)
                .filter(|w| w[0].0 == w[1].0 && added[w[0].1].0 == added[w[1].1].0)
                .map(|w| w[1].1)
                .min()?
        };
        let (_, node, pos) = added[first];
        Some((node, pos))
    }
}

/// Each module's children in document order, as one list: module `m`'s
/// are `children[starts[m]..starts[m + 1]]`.
struct ChildLists {
    starts: Vec<usize>,
    children: Vec<usize>,
}

impl ChildLists {
    fn of(&self, m: usize) -> &[usize] {
        &self.children[self.starts[m]..self.starts[m + 1]]
    }
}

/// The children lists of the first pass's modules. A child belongs to its
/// parent's last `children` list only (a repeated key replaces the list).
fn children_lists(modules: &[RawModule]) -> ChildLists {
    let belongs = |c: usize| -> Option<usize> {
        let p = modules[c].parent;
        match modules.get(p as usize)?.children {
            Some(span) if span.range().contains(&c) => Some(p as usize),
            _ => None,
        }
    };
    let mut starts = vec![0usize; modules.len() + 1];
    for c in 0..modules.len() {
        if let Some(p) = belongs(c) {
            starts[p + 1] += 1;
        }
    }
    for m in 0..modules.len() {
        starts[m + 1] += starts[m];
    }
    let mut fill = starts.clone();
    let mut children = vec![0usize; starts[modules.len()]];
    for c in 0..modules.len() {
        if let Some(p) = belongs(c) {
            children[fill[p]] = c;
            fill[p] += 1;
        }
    }
    ChildLists { starts, children }
}

impl ModuleTree {
    /// Writes the tree as a `bigmodel-module-tree/1` document.
    pub fn to_json(&self) -> serde_json::Value {
        fn module_json(tree: &ModuleTree, id: ModuleId) -> serde_json::Value {
            let m = tree.module(id);
            let mut obj = serde_json::Map::new();
            if id != 0 {
                let local = m.name.rsplit('.').next().unwrap_or(m.name);
                obj.insert("name".into(), local.into());
            }
            obj.insert("class".into(), m.class.into());
            let tensor_json = |t: TensorId| {
                let t = tree.tensor(t);
                let mut o = serde_json::Map::new();
                o.insert(
                    "name".into(),
                    t.name.rsplit('.').next().unwrap_or(t.name).into(),
                );
                o.insert("shape".into(), t.meta.shape.clone().into());
                o.insert("dtype".into(), t.meta.dtype.as_safetensors_str().into());
                if let TensorKind::Buffer { persistent: false } = t.kind {
                    o.insert("persistent".into(), false.into());
                }
                serde_json::Value::Object(o)
            };
            if !m.params.is_empty() {
                obj.insert(
                    "params".into(),
                    m.params.iter().map(|t| tensor_json(*t)).collect(),
                );
            }
            if !m.buffers.is_empty() {
                obj.insert(
                    "buffers".into(),
                    m.buffers.iter().map(|t| tensor_json(*t)).collect(),
                );
            }
            if !m.children.is_empty() {
                obj.insert(
                    "children".into(),
                    m.children.iter().map(|c| module_json(tree, *c)).collect(),
                );
            }
            serde_json::Value::Object(obj)
        }
        serde_json::json!({
            "format": FORMAT,
            "root": module_json(self, 0),
            "tied": self.tied_names(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tree::Node;
    use std::cell::Cell;

    const SPEC_EXAMPLE: &str = r#"{
      "format": "bigmodel-module-tree/1",
      "root": {
        "class": "LlamaForCausalLM",
        "children": [
          {"name": "model", "class": "LlamaModel", "children": [
            {"name": "embed_tokens", "class": "Embedding",
             "params": [{"name": "weight", "shape": [32000, 4096], "dtype": "F16"}]},
            {"name": "rotary_emb", "class": "LlamaRotaryEmbedding",
             "buffers": [{"name": "inv_freq", "shape": [64], "dtype": "F32", "persistent": false}]}
          ]},
          {"name": "lm_head", "class": "Linear",
           "params": [{"name": "weight", "shape": [32000, 4096], "dtype": "F16"}]}
        ]
      },
      "tied": [["lm_head.weight", "model.embed_tokens.weight"]],
      "extra": "ignored"
    }"#;

    #[test]
    fn the_spec_example_parses_and_round_trips() {
        let tree = ModuleTree::from_json_str(SPEC_EXAMPLE).unwrap();
        let names: Vec<_> = tree
            .preorder()
            .iter()
            .map(|m| tree.module(*m).name)
            .collect();
        assert_eq!(
            names,
            [
                "",
                "model",
                "model.embed_tokens",
                "model.rotary_emb",
                "lm_head"
            ]
        );
        let emb = match tree.find("model.embed_tokens.weight") {
            Some(Node::Tensor(t)) => t,
            other => panic!("{other:?}"),
        };
        let head = match tree.find("lm_head.weight") {
            Some(Node::Tensor(t)) => t,
            other => panic!("{other:?}"),
        };
        assert!(
            tree.tensor(emb).counted,
            "first in named_parameters order is counted"
        );
        assert!(!tree.tensor(head).counted);
        assert_eq!(
            tree.tied_names(),
            vec![vec!["lm_head.weight", "model.embed_tokens.weight"]]
        );
        let again = ModuleTree::from_json(&tree.to_json()).unwrap();
        assert_eq!(again.to_json(), tree.to_json());
        // Non-persistent buffers are not in the state dict.
        let sd: Vec<_> = tree
            .state_dict()
            .iter()
            .map(|t| tree.tensor(*t).name.to_string())
            .collect();
        assert_eq!(sd, ["model.embed_tokens.weight", "lm_head.weight"]);
    }

    fn err(doc: &str) -> String {
        ModuleTree::from_json_str(doc).unwrap_err().to_string()
    }

    #[test]
    fn malformed_documents_give_errors_naming_the_path() {
        assert!(
            err(r#"{"format":"bigmodel-module-tree/2","root":{"class":"M"}}"#)
                .contains("unknown format")
        );
        assert!(err(r#"{"root":{"class":"M"}}"#).contains("format"));
        assert!(err("[1]").contains("JSON object"));
        assert!(err("{").contains("not valid JSON"));
        let dup = r#"{"format":"bigmodel-module-tree/1","root":{"class":"M","children":[
            {"name":"a","class":"L"},{"name":"a","class":"L"}]}}"#;
        assert!(err(dup).contains("at a: duplicate name"), "{}", err(dup));
        let dtype = r#"{"format":"bigmodel-module-tree/1","root":{"class":"M","children":[
            {"name":"a","class":"L","params":[{"name":"w","shape":[2],"dtype":"F17"}]}]}}"#;
        assert!(
            err(dtype).contains("at a.w: unknown dtype \"F17\""),
            "{}",
            err(dtype)
        );
        let neg = r#"{"format":"bigmodel-module-tree/1","root":{"class":"M","children":[
            {"name":"a","class":"L","params":[{"name":"w","shape":[2,-1],"dtype":"F32"}]}]}}"#;
        assert!(
            err(neg).contains("at a.w: shape dimension -1"),
            "{}",
            err(neg)
        );
        let tie = r#"{"format":"bigmodel-module-tree/1","root":{"class":"M","children":[
            {"name":"a","class":"L","params":[{"name":"w","shape":[2],"dtype":"F32"}]}]},
            "tied":[["a.w","b.w"]]}"#;
        assert!(
            err(tie).contains("\"b.w\" is not a parameter"),
            "{}",
            err(tie)
        );
        let shape = r#"{"format":"bigmodel-module-tree/1","root":{"class":"M","children":[
            {"name":"a","class":"L","params":[{"name":"w","shape":[2],"dtype":"F32"}]},
            {"name":"b","class":"L","params":[{"name":"w","shape":[3],"dtype":"F32"}]}]},
            "tied":[["a.w","b.w"]]}"#;
        assert!(
            err(shape).contains("cannot share storage"),
            "{}",
            err(shape)
        );
        let named_root = r#"{"format":"bigmodel-module-tree/1","root":{"name":"x","class":"M"}}"#;
        assert!(err(named_root).contains("root"));
        let dotted = r#"{"format":"bigmodel-module-tree/1","root":{"class":"M","children":[{"name":"a.b","class":"L"}]}}"#;
        assert!(err(dotted).contains("no '.'"));
        let no_class =
            r#"{"format":"bigmodel-module-tree/1","root":{"class":"M","children":[{"name":"a"}]}}"#;
        assert!(err(no_class).contains("at a: missing \"class\""));
    }

    /// A module-tree document around `root` (a module object's text).
    fn doc(root: &str) -> String {
        format!(r#"{{"format":"bigmodel-module-tree/1","root":{root}}}"#)
    }

    #[test]
    fn errors_give_the_byte_line_and_column_of_the_value() {
        let text = "{\"format\":\"bigmodel-module-tree/1\",\"root\":{\"class\":\"M\",\n\"children\":[{\"name\":\"a\",\"class\":\"L\",\n  \"params\":[{\"name\":\"w\",\"shape\":[2],\"dtype\":\"F17\"}]}]}}";
        assert_eq!(
            err(text),
            "invalid module tree at a.w: unknown dtype \"F17\" (expected F64 F32 F16 BF16 I64 I32 I16 I8 U8 BOOL F8_E4M3 F8_E5M2) at byte 137 (line 3, column 45)"
        );
        let dup = "{\"format\":\"bigmodel-module-tree/1\",\"root\":{\"class\":\"M\",\"children\":[\n{\"name\":\"a\",\"class\":\"L\"},\n  {\"name\":\"a\",\"class\":\"L\"}]}}";
        assert_eq!(
            err(dup),
            "invalid module tree at a: duplicate name among siblings at byte 96 (line 3, column 3)"
        );
        let syntax = "{\"format\":\"bigmodel-module-tree/1\",\n\"root\":{\"class\":\"M\",}}";
        assert_eq!(
            err(syntax),
            "invalid module tree: not valid JSON: expected a key at byte 56 (line 2, column 21)"
        );
    }

    #[test]
    fn every_kind_of_wrong_value_names_its_path() {
        let cases = [
            (
                r#"{"class":"M","children":{}}"#,
                "at root: \"children\" must be a list",
            ),
            (
                r#"{"class":"M","children":[1]}"#,
                "at root: each child must be an object",
            ),
            (
                r#"{"class":"M","children":[{"name":2,"class":"L"}]}"#,
                "at root: a child module has no \"name\" string",
            ),
            (
                r#"{"class":"M","children":[{"name":"a","class":["L"]}]}"#,
                "at a: missing \"class\" string",
            ),
            (
                r#"{"class":"M","params":{"name":"w"}}"#,
                "at root: \"params\" must be a list",
            ),
            (
                r#"{"class":"M","buffers":["w"]}"#,
                "at root: each entry of \"buffers\" must be an object",
            ),
            (
                r#"{"class":"M","params":[{"shape":[1],"dtype":"F32"}]}"#,
                "at root: an entry of \"params\" has no \"name\" string",
            ),
            (
                r#"{"class":"M","params":[{"name":"w","shape":[1]}]}"#,
                "at w: missing \"dtype\" string",
            ),
            (
                r#"{"class":"M","params":[{"name":"w","shape":[1],"dtype":32}]}"#,
                "at w: missing \"dtype\" string",
            ),
            (
                r#"{"class":"M","params":[{"name":"w","dtype":"F32"}]}"#,
                "at w: missing \"shape\" list",
            ),
            (
                r#"{"class":"M","params":[{"name":"w","shape":"2","dtype":"F32"}]}"#,
                "at w: missing \"shape\" list",
            ),
            (
                r#"{"class":"M","params":[{"name":"w","shape":[1.5],"dtype":"F32"}]}"#,
                "at w: shape dimension 1.5 is not",
            ),
            (
                r#"{"class":"M","params":[{"name":"w","shape":[1e3],"dtype":"F32"}]}"#,
                "at w: shape dimension 1e3 is not",
            ),
            (
                r#"{"class":"M","params":[{"name":"w","shape":["2"],"dtype":"F32"}]}"#,
                "at w: shape dimension \"2\" is not",
            ),
            (
                r#"{"class":"M","params":[{"name":"w","shape":[99999999999999999999],"dtype":"F32"}]}"#,
                "at w: shape dimension 99999999999999999999 is not",
            ),
            (
                r#"{"class":"M","buffers":[{"name":"b","shape":[1],"dtype":"F32","persistent":0}]}"#,
                "at b: \"persistent\" must be true or false, found 0",
            ),
            (
                r#"{"class":"M","params":[{"name":"w","shape":[1],"dtype":"F32","persistent":true}]}"#,
                "at w: \"persistent\" applies to buffers only",
            ),
            (
                r#"{"class":"M","params":[{"name":"w","shape":[1],"dtype":"F32"},{"name":"w","shape":[1],"dtype":"F32"}]}"#,
                "at w: duplicate name",
            ),
            (
                r#"{"class":"M","params":[{"name":"","shape":[1],"dtype":"F32"}]}"#,
                "must be non-empty",
            ),
            (r#"{"class":7}"#, "at root: missing \"class\" string"),
            (r#"[]"#, "at root: must be an object"),
        ];
        for (root, want) in cases {
            let e = err(&doc(root));
            assert!(
                e.contains(want) && e.contains(" (line 1, column "),
                "{root}: {e}"
            );
        }
        let tied = |tied: &str| {
            err(&format!(
                r#"{{"format":"bigmodel-module-tree/1","root":{{"class":"M","params":[{{"name":"w","shape":[1],"dtype":"F32"}}]}},"tied":{tied}}}"#
            ))
        };
        assert!(tied(r#"{"a":1}"#).contains("at tied: must be a list of lists"));
        assert!(tied(r#"[["w","w"],"w"]"#).contains("at tied[1]: must be a list of names"));
        assert!(tied(r#"[["w",1]]"#).contains("at tied[0]: names must be strings"));
        assert!(
            tied(r#"[["w"]]"#)
                .contains("at tied[0]: a tied group needs at least two names at byte")
        );
        assert!(err(r#"{"format":7,"root":{"class":"M"}}"#).contains("missing \"format\""));
        assert!(err(r#"{"format":"bigmodel-module-tree/1"}"#).contains("at root: missing"));
        assert!(
            err(r#"{"format":"bigmodel-module-tree/1","root":{"class":"M"},"x":[1,}"#)
                .contains("not valid JSON")
        );
        assert!(
            err(r#"{"format":"bigmodel-module-tree/1","root":{"class":"M"}} {}"#)
                .contains("trailing characters")
        );
        assert!(err("\"text\"").contains("JSON object"));
    }

    #[test]
    fn keys_may_come_in_any_order_and_a_repeated_key_keeps_its_last_value() {
        let canonical = ModuleTree::from_json_str(SPEC_EXAMPLE).unwrap().to_json();
        let shuffled = r#"{
          "tied": [["lm_head.weight", "model.embed_tokens.weight"]],
          "root": {
            "children": [
              {"children": [
                {"params": [{"dtype": "F16", "shape": [32000, 4096], "name": "weight"}],
                 "class": "Embedding", "name": "embed_tokens"},
                {"buffers": [{"persistent": false, "dtype": "F32", "shape": [64], "name": "inv_freq"}],
                 "name": "rotary_emb", "class": "LlamaRotaryEmbedding"}
               ], "class": "LlamaModel", "name": "model"},
              {"params": [{"name": "weight", "shape": [32000, 4096], "dtype": "F16"}],
               "name": "lm_head", "class": "Linear"}
            ],
            "class": "LlamaForCausalLM"
          },
          "format": "bigmodel-module-tree/1"
        }"#;
        assert_eq!(
            ModuleTree::from_json_str(shuffled).unwrap().to_json(),
            canonical
        );
        // serde_json keeps the last of repeated keys; so does the reader.
        let repeated = r#"{"format":"x","format":"bigmodel-module-tree/1","root":{"class":"M",
            "children":[{"name":"gone","class":"L"}],
            "children":[{"name":"kept","class":"L","children":[{"name":"x","class":"L"}],"children":[]}]}}"#;
        let tree = ModuleTree::from_json_str(repeated).unwrap();
        let names: Vec<_> = tree.modules().map(|m| m.name).collect();
        assert_eq!(names, ["", "kept"]);
        let value: serde_json::Value = serde_json::from_str(repeated).unwrap();
        assert_eq!(
            ModuleTree::from_json(&value).unwrap().to_json(),
            tree.to_json()
        );
        // A wrong value is refused even where a later repeat replaces it.
        let e = err(&doc(r#"{"class":"M","children":{},"children":[]}"#));
        assert!(e.contains("at root: \"children\" must be a list"), "{e}");
    }

    #[test]
    fn ids_follow_the_order_the_tree_was_always_built_in() {
        // A module's children get consecutive ids before any grandchild.
        let text = doc(r#"{"class":"M","children":[
            {"name":"a","class":"L","children":[{"name":"x","class":"L"}]},
            {"name":"b","class":"L","params":[{"name":"w","shape":[1],"dtype":"F32"}]}]}"#);
        let tree = ModuleTree::from_json_str(&text).unwrap();
        let names: Vec<_> = tree.modules().map(|m| m.name).collect();
        assert_eq!(names, ["", "a", "b", "a.x"]);
        assert_eq!(tree.find("b.w"), Some(Node::Tensor(0)));
    }

    /// A chain of `depth` modules named `name`, the last with `tensors`
    /// parameters.
    fn chain(depth: usize, name: &str, tensors: usize) -> String {
        let mut text = String::from(r#"{"format":"bigmodel-module-tree/1","root":{"class":"M""#);
        for _ in 0..depth {
            write!(text, r#","children":[{{"name":"{name}","class":"D""#).unwrap();
        }
        let params: Vec<String> = (0..tensors)
            .map(|t| format!(r#"{{"name":"w{t}","shape":[1],"dtype":"F32"}}"#))
            .collect();
        write!(text, r#","params":[{}]"#, params.join(",")).unwrap();
        text.push_str(&"}]".repeat(depth));
        text.push_str("}}");
        text
    }

    #[test]
    fn nesting_stops_where_serde_json_stops_and_names_have_a_budget() {
        // The document, the root, then a `children` list and a module
        // object per level: 128 levels of JSON nesting is 63 modules deep.
        for depth in [62, 63] {
            let text = chain(depth, "d", 1);
            let serde = serde_json::from_str::<serde_json::Value>(&text).is_ok();
            match ModuleTree::from_json_str(&text) {
                Ok(tree) => {
                    assert!(serde, "{depth}");
                    assert_eq!(tree.modules().len(), depth + 1);
                    let path = vec!["d"; depth].join(".");
                    assert!(tree.find(&format!("{path}.w0")).is_some());
                }
                Err(e) => {
                    assert!(!serde, "{depth}");
                    assert!(e.to_string().contains("nesting 128 levels deep"), "{e}");
                }
            }
        }
        // 60 levels of 1000-byte names and 200 short tensor entries below
        // them: 12 MB of dotted tensor names from 68 kB of text.
        let e = err(&chain(60, &"d".repeat(1000), 200));
        assert!(
            e.contains("32 times the size of the document: the tree nests too deep"),
            "{e}"
        );
    }

    #[test]
    fn escaped_names_are_read_as_serde_json_reads_them() {
        let text = doc(r#"{"class":"M\u00e9","children":[{"name":"\u0061\"b","class":"L\n"}]}"#);
        let tree = ModuleTree::from_json_str(&text).unwrap();
        assert_eq!(tree.module(0).class, "Mé");
        assert_eq!(tree.module(1).name, "a\"b");
        assert_eq!(tree.module(1).class, "L\n");
    }

    #[test]
    fn damaged_documents_give_errors_not_panics() {
        // Every truncation, and every byte replaced by a character that
        // changes the grammar, of a document that uses every key.
        let text = SPEC_EXAMPLE;
        let mut damaged: Vec<String> = (0..text.len())
            .filter(|&i| text.is_char_boundary(i))
            .map(|i| text[..i].to_string())
            .collect();
        for (i, _) in text.char_indices() {
            for with in ['"', '{', '}', '[', ']', ',', ':', '1', '-', 'x', '\\'] {
                let mut t = text.to_string();
                t.replace_range(
                    i..i + text[i..].chars().next().map_or(1, char::len_utf8),
                    &with.to_string(),
                );
                damaged.push(t);
            }
        }
        for t in &damaged {
            if let Err(e) = ModuleTree::from_json_str(t) {
                assert!(e.to_string().starts_with("invalid module tree"), "{t}: {e}");
            }
        }
    }

    #[test]
    fn is_document_reads_only_the_top_level_keys() {
        assert!(ModuleTree::is_document(SPEC_EXAMPLE));
        // `root` first: its value is skipped to find `format`.
        assert!(ModuleTree::is_document(
            r#"{"root":{"a":[1,2]},"format":1}"#
        ));
        // Decided before the malformed rest is reached.
        assert!(ModuleTree::is_document(r#"{"format":1,"root": oops"#));
        for other in [
            r#"{"model_type":"llama","root":1}"#,
            r#"{"weight_map":{}}"#,
            r#"[{"format":1,"root":2}]"#,
            r#"{"format":1,"x":[}"#,
            "",
        ] {
            assert!(!ModuleTree::is_document(other), "{other}");
        }
    }

    thread_local! {
        /// Documents joined from two parts on this thread.
        pub(super) static SPLICED: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
        /// Whether tensors are read with plain tokens on this thread.
        pub(super) static PLAIN: std::cell::Cell<bool> = const { std::cell::Cell::new(true) };
        /// Tensors read with plain tokens on this thread.
        pub(super) static PLAIN_READ: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
    }

    /// A small deterministic generator (xorshift) for the split tests.
    struct Rng(u64);

    impl Rng {
        fn below(&mut self, n: usize) -> usize {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            (self.0 % n as u64) as usize
        }
    }

    /// A module object of a random tree, its keys in a random order, with
    /// white space or not, and now and then something wrong or unusual
    /// (a key repeated, a child with no class, a bad dtype, a list item
    /// that is not an object).
    fn module_text(rng: &mut Rng, depth: usize, name: Option<String>, odd: bool) -> String {
        let ws = if rng.below(4) == 0 { "\n  " } else { "" };
        let mut keys: Vec<String> = Vec::new();
        if let Some(name) = name {
            keys.push(format!("\"name\":{ws}\"{name}\""));
        }
        if !(odd && rng.below(40) == 0) {
            keys.push(format!("\"class\":\"C{}\"", rng.below(3)));
        }
        let tensor = |rng: &mut Rng, i: usize| {
            let dtype = if odd && rng.below(60) == 0 {
                "F17"
            } else {
                "F32"
            };
            format!(
                "{{\"name\":\"t{i}\",\"shape\":[{},{}],{ws}\"dtype\":\"{dtype}\"}}",
                1 + rng.below(4),
                rng.below(3)
            )
        };
        if rng.below(2) == 0 {
            let n = rng.below(3);
            let list: Vec<String> = (0..n).map(|i| tensor(rng, i)).collect();
            keys.push(format!("\"params\":[{}]", list.join(",")));
        }
        if rng.below(5) == 0 {
            keys.push(format!(
                "\"buffers\":[{{\"name\":\"b\",\"shape\":[],\"dtype\":\"I64\",\"persistent\":{}}}]",
                rng.below(2) == 0
            ));
        }
        if depth > 0 {
            let n = 1 + rng.below(4);
            let mut list: Vec<String> = (0..n)
                .map(|i| module_text(rng, depth - 1, Some(format!("m{i}")), odd))
                .collect();
            if odd && rng.below(50) == 0 {
                list.push("7".into());
            }
            keys.push(format!(
                "\"children\":[{ws}{}]",
                list.join(&format!(",{ws}"))
            ));
            if odd && rng.below(60) == 0 {
                keys.push("\"children\":[]".into());
            }
        }
        if rng.below(6) == 0 {
            keys.push("\"note\":{\"x\":[1,{\"y\":null}]}".into());
        }
        // Any order: a module's name may come after its children.
        for i in (1..keys.len()).rev() {
            keys.swap(i, rng.below(i + 1));
        }
        format!("{{{ws}{}}}", keys.join(&format!(",{ws}")))
    }

    /// What reading `text` gives: the tree (its document and its ids'
    /// names) or the error.
    fn outcome(
        text: &str,
        read: Pass<RawDocument<'_>>,
    ) -> Result<(serde_json::Value, Vec<String>), String> {
        let tree = match read {
            Ok(doc) => build(text, doc),
            Err(stop) => match *stop {
                Stop::Invalid(e) => Err(e),
                Stop::Syntax(e) => Err(Error::tree("", format!("not valid JSON: {e}"))),
            },
        };
        tree.map(|t| {
            crate::tree::assert_structure_of_tables(&t);
            let names = t
                .modules()
                .map(|m| m.name.to_string())
                .chain(t.tensors().map(|x| x.name.to_string()))
                .collect();
            (t.to_json(), names)
        })
        .map_err(|e| e.to_string())
    }

    #[test]
    fn reading_in_two_parts_gives_what_one_reader_gives_wherever_it_splits() {
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
        let (mut splits, mut trees, mut errors) = (0, 0, 0);
        for case in 0..80 {
            let odd = case % 3 == 0;
            let root = module_text(&mut rng, 2 + case % 3, None, odd);
            let tied = if rng.below(3) == 0 {
                r#","tied":[["m0.t0","m1.t0"]]"#
            } else {
                ""
            };
            let text = format!(r#"{{"format":"bigmodel-module-tree/1","root":{root}{tied}}}"#);
            let one = outcome(&text, read_from(&text, None));
            match &one {
                Ok(_) => trees += 1,
                Err(_) => errors += 1,
            }
            // Every place after a `}`, module or not.
            for at in text.match_indices('}').map(|(i, _)| i + 1) {
                let two = outcome(&text, read_split(&text, at));
                assert_eq!(two, one, "case {case}, split at {at}:\n{text}");
                splits += 1;
            }
        }
        // Both kinds of document, and most splits between two modules
        // joined rather than read again.
        let spliced = SPLICED.with(|n| n.get());
        assert!(trees > 15 && errors > 8, "{trees} trees, {errors} errors");
        assert!(
            splits > 3000 && spliced > splits / 5,
            "{spliced} of {splits}"
        );
    }

    /// A module whose children and tensors are named from a small pool, so
    /// that siblings now and then share a name (a module's with a tensor's
    /// too); some lists are longer than `FEW_SIBLINGS`.
    fn crowded_module(rng: &mut Rng, depth: usize, name: Option<String>) -> serde_json::Value {
        let long = rng.below(4) == 0;
        let (prefix, pool) = if long { ("x", 60) } else { ("n", 6) };
        let pick = |rng: &mut Rng| format!("{prefix}{}", rng.below(pool));
        let count = |rng: &mut Rng| {
            if long {
                10 + rng.below(20)
            } else {
                rng.below(3)
            }
        };
        let tensor = |name: String| serde_json::json!({"name": name, "shape": [1], "dtype": "F32"});
        let params: Vec<_> = (0..count(rng)).map(|_| tensor(pick(rng))).collect();
        let buffers: Vec<_> = (0..rng.below(2)).map(|_| tensor(pick(rng))).collect();
        let mut module = serde_json::json!({"class": "C", "params": params, "buffers": buffers});
        if depth > 0 {
            let children: Vec<_> = (0..count(rng))
                .map(|_| {
                    let name = pick(rng);
                    crowded_module(rng, depth - 1, Some(name))
                })
                .collect();
            module["children"] = children.into();
        }
        if let Some(name) = name {
            module["name"] = name.into();
        }
        module
    }

    /// What adding the names of `root` one at a time to a builder that
    /// indexes them says, in the order the reader adds them.
    fn one_name_at_a_time(root: &serde_json::Value) -> Result<(), String> {
        let mut b = ModuleTreeBuilder::new("C");
        let mut stack = vec![(root, 0)];
        while let Some((module, id)) = stack.pop() {
            for (key, param) in [("params", true), ("buffers", false)] {
                for t in module[key].as_array().into_iter().flatten() {
                    let (name, meta) = (
                        t["name"].as_str().unwrap(),
                        TensorMeta::new(DType::F32, [1]),
                    );
                    let added = if param {
                        b.add_param(id, name, meta)
                    } else {
                        b.add_buffer(id, name, meta, true)
                    };
                    added.map_err(|e| e.to_string())?;
                }
            }
            let mut children = Vec::new();
            for c in module["children"].as_array().into_iter().flatten() {
                let name = c["name"].as_str().unwrap();
                children.push((c, b.add_module(id, name, "C").map_err(|e| e.to_string())?));
            }
            stack.extend(children.into_iter().rev());
        }
        b.finish().map(|_| ()).map_err(|e| e.to_string())
    }

    #[test]
    fn the_duplicate_found_among_siblings_is_the_one_an_index_of_all_names_finds() {
        let mut rng = Rng(0x2545_f491_4f6c_dd1d);
        // Duplicates, and those in a list longer than `FEW_SIBLINGS`.
        let (mut duplicates, mut in_long_lists) = (0, 0);
        for case in 0..300 {
            let root = crowded_module(&mut rng, 1 + case % 3, None);
            let text = serde_json::json!({"format": FORMAT, "root": root}).to_string();
            let read = ModuleTree::from_json_str(&text)
                .map(|_| ())
                .map_err(|e| e.to_string());
            match (read, one_name_at_a_time(&root)) {
                (Ok(()), Ok(())) => {}
                (Err(read), Err(indexed)) => {
                    // The reader also says where in the text.
                    assert!(
                        read.starts_with(&indexed),
                        "case {case}: {read} / {indexed}\n{text}"
                    );
                    assert!(read.contains(DUPLICATE), "{read}");
                    duplicates += 1;
                    let name = indexed.split(' ').nth(4).unwrap_or("");
                    in_long_lists += usize::from(name.rsplit('.').next().unwrap().starts_with('x'));
                }
                (read, indexed) => panic!("case {case}: {read:?} / {indexed:?}\n{text}"),
            }
        }
        assert!(duplicates > 100 && duplicates < 290, "{duplicates} of 300");
        assert!(in_long_lists > 30, "{in_long_lists}");
    }

    #[test]
    fn tensors_read_with_plain_tokens_are_what_the_general_path_reads() {
        let outcomes = |text: &str| {
            let (plain_before, spliced_before) =
                (PLAIN_READ.with(Cell::get), SPLICED.with(Cell::get));
            let plain = outcome(text, read_from(text, None));
            let plain_read = PLAIN_READ.with(Cell::get) - plain_before;
            PLAIN.with(|p| p.set(false));
            let general = outcome(text, read_from(text, None));
            PLAIN.with(|p| p.set(true));
            assert_eq!(SPLICED.with(Cell::get), spliced_before);
            (plain, general, plain_read)
        };
        // Generated trees, valid and not.
        let mut rng = Rng(0xd1b5_4a32_d192_ed03);
        let mut plain_reads = 0;
        for case in 0..60 {
            let root = module_text(&mut rng, 2 + case % 2, None, case % 2 == 0);
            let text = format!(r#"{{"format":"bigmodel-module-tree/1","root":{root}}}"#);
            let (plain, general, read) = outcomes(&text);
            assert_eq!(plain, general, "case {case}:\n{text}");
            plain_reads += read;
        }
        assert!(plain_reads > 200, "{plain_reads}");
        // Each of these tensors in a module's params and in its buffers.
        let tensors = [
            (r#"{"name":"w","shape":[2,3],"dtype":"F32"}"#, true),
            (
                r#"{ "name" : "w" , "shape" : [ ] , "dtype" : "BF16" }"#,
                true,
            ),
            (
                r#"{"name":"w","shape":[0,18446744073709551615],"dtype":"I8"}"#,
                false,
            ),
            (
                r#"{"name":"w","shape":[1234567890123456789],"dtype":"U8"}"#,
                true,
            ),
            (
                r#"{"name":"w","shape":[2],"dtype":"F32","persistent":false}"#,
                true,
            ),
            (
                r#"{"name":"w","shape":[2],"dtype":"F32","persistent":null}"#,
                false,
            ),
            (
                r#"{"name":"w","shape":[2],"dtype":"F32","persistent":true,"x":1}"#,
                false,
            ),
            (r#"{"name":"w\u002e","shape":[2],"dtype":"F32"}"#, false),
            (r#"{"name":"w","shape":[02],"dtype":"F32"}"#, false),
            (r#"{"name":"w","shape":[2.0],"dtype":"F32"}"#, false),
            (r#"{"name":"w","shape":[-2],"dtype":"F32"}"#, false),
            (r#"{"name":"w","shape":[2,],"dtype":"F32"}"#, false),
            (r#"{"name":"w","shape":[2]],"dtype":"F32"}"#, false),
            (r#"{"name":"w","shape":[2],"dtype":"F17"}"#, false),
            (r#"{"name":"w","dtype":"F32","shape":[2]}"#, false),
            (
                r#"{"name":"w","shape":[2],"dtype":"F32","name":"v"}"#,
                false,
            ),
            (r#"{"name":"","shape":[2],"dtype":"F32"}"#, true),
            (r#"{"name":"w","shape":[2],"dtype":"F32"#, false),
        ];
        for (tensor, plain_in_params) in tensors {
            for key in ["params", "buffers"] {
                let text = format!(
                    r#"{{"format":"bigmodel-module-tree/1","root":{{"class":"M","{key}":[{tensor}]}}}}"#
                );
                let (plain, general, read) = outcomes(&text);
                assert_eq!(plain, general, "{text}");
                let persistent = tensor.contains("persistent\":false");
                let expected = plain_in_params && (key == "buffers" || !persistent);
                assert_eq!(read == 1, expected, "{text}");
            }
        }
    }

    #[test]
    fn the_split_point_is_between_two_modules_past_the_middle() {
        let children: Vec<String> = (0..2000)
            .map(|i| {
                format!(
                    r#"{{"name":"{i}","class":"L","params":[{{"name":"w","shape":[2],"dtype":"F32"}},{{"name":"b","shape":[2],"dtype":"F32"}}]}}"#
                )
            })
            .collect();
        let text = format!(
            r#"{{"format":"bigmodel-module-tree/1","root":{{"class":"M","children":[{}]}}}}"#,
            children.join(",")
        );
        let at = split_point(&text).unwrap();
        assert!(at > text.len() / 2);
        assert!(
            text[at..].starts_with(r#",{"name":""#),
            "{}",
            &text[at..at + 20]
        );
        assert!(text[..at].ends_with("]}"));
        // Only tensors past the middle: nowhere to split.
        let tensors: Vec<String> = (0..2000)
            .map(|i| format!(r#"{{"name":"w{i}","shape":[2],"dtype":"F32"}}"#))
            .collect();
        let flat = format!(
            r#"{{"format":"bigmodel-module-tree/1","root":{{"class":"M","params":[{}]}}}}"#,
            tensors.join(",")
        );
        assert_eq!(split_point(&flat), None);
        // And a large document is read through it.
        assert!(text.len() < SPLIT_FROM);
        let big = text.replace(
            r#"[2],"dtype""#,
            &format!(r#"[2],"pad":"{}","dtype""#, "x".repeat(300)),
        );
        assert!(big.len() >= SPLIT_FROM);
        let tree = ModuleTree::from_json_str(&big).unwrap();
        assert_eq!(tree.module_count(), 2001);
        assert_eq!(tree.module(2000).name, "1999");
        assert_eq!(tree.tensor(3999).name, "1999.b");
    }
}
