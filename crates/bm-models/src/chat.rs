//! Chat templates: the Jinja template of a model folder
//! (`chat_template.jinja`, or `chat_template` in tokenizer_config.json)
//! rendered over a conversation as transformers' `apply_chat_template`
//! renders it: `trim_blocks` and `lstrip_blocks`, loop controls, the
//! special tokens as variables, transformers' `tojson` (Python's
//! `json.dumps`, not Jinja's HTML-safe one), `raise_exception` and
//! `strftime_now`, and Python's str and dict methods. Templates come from
//! the Hub: minijinja gives them no access to anything but their inputs, and
//! a fuel limit stops one that would run forever.

use std::path::{Path, PathBuf};

use minijinja::value::{Kwargs, Serde};
use minijinja::{Environment, ErrorKind, Value};

use crate::Error;
use crate::config::read_keys;

/// Template instructions one rendering may run: a real template spends a
/// few hundred a message, so this is thousands of messages, and few enough
/// to end a runaway loop within seconds.
const FUEL: u64 = 5_000_000;

/// The special tokens transformers passes to a template
/// (`special_tokens_map`), when tokenizer_config.json sets them.
const SPECIAL_TOKENS: [&str; 7] = [
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
];

/// A model folder's chat template(s), ready to render.
pub struct ChatTemplate {
    env: Environment<'static>,
    /// Template names: `default` for a single template, else the names of
    /// tokenizer_config.json's list.
    names: Vec<String>,
    /// The special tokens, as the template sees them.
    specials: Vec<(String, String)>,
    /// Where the template comes from, for errors.
    path: PathBuf,
}

impl ChatTemplate {
    /// The chat template of the folder `dir`: `chat_template.jinja` when
    /// present (transformers' own file for it), else tokenizer_config.json's
    /// `chat_template` (a string, or a list of `{name, template}`), with
    /// the special tokens of tokenizer_config.json.
    pub fn open_in(dir: impl AsRef<Path>) -> Result<ChatTemplate, Error> {
        let dir = dir.as_ref();
        let config_path = dir.join("tokenizer_config.json");
        let config = if bm_shard::exists(&config_path)? {
            Some(read_keys(&config_path)?)
        } else {
            None
        };
        let mut specials = Vec::new();
        if let Some(keys) = &config {
            for name in SPECIAL_TOKENS {
                // A plain string, or an AddedToken object with `content`.
                let token = match keys.get(name) {
                    None => None,
                    Some(v) => v.as_str().or_else(|| v.get("content")?.as_str()),
                };
                if let Some(token) = token {
                    specials.push((name.to_string(), token.to_string()));
                }
            }
        }
        let jinja = dir.join("chat_template.jinja");
        if bm_shard::exists(&jinja)? {
            let text = std::fs::read_to_string(&jinja).map_err(|source| Error::Io {
                source,
                path: jinja.clone(),
            })?;
            return ChatTemplate::new(jinja, vec![("default".into(), text)], specials);
        }
        let missing = || {
            Error::ChatTemplate {
            path: config_path.clone(),
            message: "the folder has no chat template (no chat_template.jinja, and no chat_template in tokenizer_config.json)".into(),
        }
        };
        let keys = config.as_ref().ok_or_else(missing)?;
        let templates = match keys.get("chat_template").ok_or_else(missing)? {
            serde_json::Value::String(text) => vec![("default".to_string(), text.clone())],
            serde_json::Value::Array(items) => items
                .iter()
                .map(|item| {
                    let field = |key: &str| item.get(key).and_then(serde_json::Value::as_str);
                    match (field("name"), field("template")) {
                        (Some(name), Some(template)) => {
                            Ok((name.to_string(), template.to_string()))
                        }
                        _ => Err(keys.error(
                            "chat_template",
                            format!("expected {{\"name\", \"template\"}} items, found {item}"),
                        )),
                    }
                })
                .collect::<Result<_, _>>()?,
            other => {
                return Err(keys
                    .error(
                        "chat_template",
                        format!("expected a string or a list, found {other}"),
                    )
                    .into());
            }
        };
        ChatTemplate::new(config_path, templates, specials)
    }

    /// Compiles `templates` (name, source) from `path`.
    fn new(
        path: PathBuf,
        templates: Vec<(String, String)>,
        specials: Vec<(String, String)>,
    ) -> Result<ChatTemplate, Error> {
        let mut env = Environment::new();
        let syntax = minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(|e| template_error(&path, &e))?;
        env.set_syntax(syntax);
        env.set_fuel(Some(FUEL));
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_filter("tojson", tojson);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        let mut names = Vec::new();
        for (name, source) in templates {
            env.add_template_owned(name.clone(), source)
                .map_err(|e| template_error(&path, &e))?;
            names.push(name);
        }
        Ok(ChatTemplate {
            env,
            names,
            specials,
            path,
        })
    }

    /// The conversation `messages` (JSON objects with `role`, `content`
    /// and whatever else the template reads) rendered as
    /// `apply_chat_template(messages, tools=tools, tokenize=False,
    /// add_generation_prompt=...)` renders it. Keys whose value is `null`
    /// are dropped from each message first, as transformers does. With
    /// several templates, `tool_use` renders when tools are given and it
    /// exists, else `default`.
    pub fn render(
        &self,
        messages: &[serde_json::Value],
        tools: Option<&[serde_json::Value]>,
        add_generation_prompt: bool,
    ) -> Result<String, Error> {
        if messages.is_empty() {
            return Err(Error::EmptyInput("conversation"));
        }
        let name = self.template_name(tools.is_some())?;
        let template = self
            .env
            .get_template(name)
            .map_err(|e| template_error(&self.path, &e))?;
        let messages: Vec<serde_json::Value> = messages
            .iter()
            .map(|m| match m {
                serde_json::Value::Object(fields) => serde_json::Value::Object(
                    fields
                        .iter()
                        .filter(|(_, v)| !v.is_null())
                        .map(|(k, v)| (k.clone(), v.clone()))
                        .collect(),
                ),
                other => other.clone(),
            })
            .collect();
        let mut context: Vec<(String, Value)> = self
            .specials
            .iter()
            .map(|(k, v)| (k.clone(), Value::from(v.as_str())))
            .collect();
        context.push(("messages".into(), Value::from(Serde(&messages))));
        context.push((
            "tools".into(),
            tools.map_or(Value::from(()), |t| Value::from(Serde(t))),
        ));
        context.push((
            "add_generation_prompt".into(),
            Value::from(add_generation_prompt),
        ));
        let context = Value::from_pairs(context);
        template
            .render(context)
            .map_err(|e| template_error(&self.path, &e))
    }

    /// The template to render, as transformers' `get_chat_template` picks.
    fn template_name(&self, with_tools: bool) -> Result<&str, Error> {
        if let [only] = &self.names[..] {
            return Ok(only);
        }
        let has = |name: &str| self.names.iter().any(|n| n == name);
        if with_tools && has("tool_use") {
            Ok("tool_use")
        } else if has("default") {
            Ok("default")
        } else {
            Err(Error::ChatTemplate {
                path: self.path.clone(),
                message: format!(
                    "several templates ({}) and none is named default",
                    self.names.join(", ")
                ),
            })
        }
    }
}

/// A minijinja error as ours: its message, the template's name and line,
/// and what caused it.
fn template_error(path: &Path, e: &minijinja::Error) -> Error {
    let mut message = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(cause) = source {
        message.push_str(&format!(": {cause}"));
        source = cause.source();
    }
    Error::ChatTemplate {
        path: path.to_path_buf(),
        message,
    }
}

/// transformers' `raise_exception(message)`: the template refuses the
/// conversation.
fn raise_exception(message: String) -> Result<Value, minijinja::Error> {
    Err(minijinja::Error::new(ErrorKind::InvalidOperation, message))
}

/// transformers' `tojson`: Python's `json.dumps(x, ensure_ascii=False,
/// indent=None, separators=None, sort_keys=False)`, whose defaults put a
/// space after `,` and `:`, and which escapes no HTML characters.
fn tojson(value: Value, kwargs: Kwargs) -> Result<String, minijinja::Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    let separators: Option<Vec<String>> = kwargs.get("separators")?;
    kwargs.assert_all_used()?;
    let bad = |message: String| minijinja::Error::new(ErrorKind::InvalidOperation, message);
    let mut json = serde_json::to_value(&value).map_err(|e| bad(format!("tojson: {e}")))?;
    if sort_keys == Some(true) {
        sort_keys_of(&mut json);
    }
    let (item, key) = match separators.as_deref() {
        None if indent.is_some() => (",".to_string(), ": ".to_string()),
        None => (", ".to_string(), ": ".to_string()),
        Some([item, key]) => (item.clone(), key.clone()),
        Some(other) => {
            return Err(bad(format!(
                "tojson: separators must be two strings, found {other:?}"
            )));
        }
    };
    let mut out = String::new();
    let layout = Layout {
        item: &item,
        key: &key,
        indent: indent.map(|n| " ".repeat(n)),
    };
    layout.write(&json, 0, &mut out);
    Ok(if ensure_ascii == Some(true) {
        ascii_escaped(&out)
    } else {
        out
    })
}

/// Sorts every object's keys (Python's `sort_keys=True`).
fn sort_keys_of(value: &mut serde_json::Value) {
    match value {
        serde_json::Value::Object(map) => {
            map.sort_keys();
            map.values_mut().for_each(sort_keys_of);
        }
        serde_json::Value::Array(items) => items.iter_mut().for_each(sort_keys_of),
        _ => {}
    }
}

/// Non-ASCII characters as `\uXXXX` (surrogate pairs past the BMP), as
/// Python's `ensure_ascii=True`. Only string contents hold such characters
/// in JSON text, so escaping the whole text is escaping the strings.
fn ascii_escaped(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        if c.is_ascii() {
            out.push(c);
        } else {
            let mut units = [0u16; 2];
            for unit in c.encode_utf16(&mut units) {
                out.push_str(&format!("\\u{unit:04x}"));
            }
        }
    }
    out
}

/// Python's `json.dumps` layout: `item` between items, `key` after a key,
/// and with an indent, every item on its own line (empty containers stay
/// `[]` and `{}`). Strings are escaped as serde_json and Python both do
/// with `ensure_ascii=False`.
struct Layout<'a> {
    item: &'a str,
    key: &'a str,
    indent: Option<String>,
}

impl Layout<'_> {
    fn write(&self, value: &serde_json::Value, depth: usize, out: &mut String) {
        use serde_json::Value as J;
        match value {
            J::Array(items) if !items.is_empty() => {
                out.push('[');
                for (i, v) in items.iter().enumerate() {
                    self.separate(i == 0, depth + 1, out);
                    self.write(v, depth + 1, out);
                }
                self.newline(depth, out);
                out.push(']');
            }
            J::Object(map) if !map.is_empty() => {
                out.push('{');
                for (i, (k, v)) in map.iter().enumerate() {
                    self.separate(i == 0, depth + 1, out);
                    out.push_str(&J::String(k.clone()).to_string());
                    out.push_str(self.key);
                    self.write(v, depth + 1, out);
                }
                self.newline(depth, out);
                out.push('}');
            }
            other => out.push_str(&other.to_string()),
        }
    }

    fn separate(&self, first: bool, depth: usize, out: &mut String) {
        if !first {
            out.push_str(self.item);
        }
        self.newline(depth, out);
    }

    fn newline(&self, depth: usize, out: &mut String) {
        if let Some(indent) = &self.indent {
            out.push('\n');
            for _ in 0..depth {
                out.push_str(indent);
            }
        }
    }
}

/// transformers' `strftime_now(format)`: the current UTC time formatted
/// with Python's `strftime` codes (those chat templates use: `%d %m %Y %y
/// %b %B %a %A %H %M %S %j %%`; others are an error naming them).
fn strftime_now(format: String) -> Result<String, minijinja::Error> {
    let seconds = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    strftime(&format, seconds)
}

/// `format` for the UTC time `seconds` after the Unix epoch.
fn strftime(format: &str, seconds: u64) -> Result<String, minijinja::Error> {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = [
        "Monday",
        "Tuesday",
        "Wednesday",
        "Thursday",
        "Friday",
        "Saturday",
        "Sunday",
    ];
    let days = seconds / 86_400;
    let (year, month, day) = civil_from_days(days);
    let secs = seconds % 86_400;
    // 1970-01-01 was a Thursday (index 3 from Monday).
    let weekday = ((days + 3) % 7) as usize;
    let leap = (year % 4 == 0 && year % 100 != 0) || year % 400 == 0;
    let before: [u64; 12] = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
    let yday = before[month as usize - 1] + day + u64::from(leap && month > 2);
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let month_name = MONTHS[month as usize - 1];
        match chars.next() {
            Some('d') => out.push_str(&format!("{day:02}")),
            Some('m') => out.push_str(&format!("{month:02}")),
            Some('Y') => out.push_str(&year.to_string()),
            Some('y') => out.push_str(&format!("{:02}", year % 100)),
            Some('b') => out.push_str(&month_name[..3]),
            Some('B') => out.push_str(month_name),
            Some('a') => out.push_str(&DAYS[weekday][..3]),
            Some('A') => out.push_str(DAYS[weekday]),
            Some('H') => out.push_str(&format!("{:02}", secs / 3600)),
            Some('M') => out.push_str(&format!("{:02}", secs / 60 % 60)),
            Some('S') => out.push_str(&format!("{:02}", secs % 60)),
            Some('j') => out.push_str(&format!("{yday:03}")),
            Some('%') => out.push('%'),
            other => {
                return Err(minijinja::Error::new(
                    ErrorKind::InvalidOperation,
                    format!(
                        "strftime_now: the code %{} is not supported",
                        other.map(String::from).unwrap_or_default()
                    ),
                ));
            }
        }
    }
    Ok(out)
}

/// (year, month 1..=12, day 1..=31) of `days` after 1970-01-01 (Howard
/// Hinnant's `civil_from_days`).
fn civil_from_days(days: u64) -> (u64, u64, u64) {
    let z = days + 719_468;
    let era = z / 146_097;
    let doe = z % 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + u64::from(month <= 2);
    (year, month, day)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn template(source: &str) -> ChatTemplate {
        ChatTemplate::new(
            PathBuf::from("tokenizer_config.json"),
            vec![("default".into(), source.into())],
            vec![("bos_token".into(), "<s>".into())],
        )
        .unwrap()
    }

    fn user(text: &str) -> serde_json::Value {
        json!({"role": "user", "content": text})
    }

    #[test]
    fn tojson_writes_what_pythons_json_dumps_writes() {
        let t = template(
            "{{ messages[0] | tojson }}|{{ messages[0] | tojson(indent=2) }}|{{ [] | tojson(indent=2) }}|{{ messages[0] | tojson(sort_keys=true, ensure_ascii=true) }}",
        );
        let message = json!({"role": "user", "content": "<a & 'b'> «°C»", "n": [1, 2.5, {}]});
        let text = t.render(&[message], None, false).unwrap();
        // json.dumps(m), json.dumps(m, indent=2), json.dumps([], indent=2),
        // json.dumps(m, sort_keys=True, ensure_ascii=True) in Python 3.11.
        let want = [
            r#"{"role": "user", "content": "<a & 'b'> «°C»", "n": [1, 2.5, {}]}"#,
            "{\n  \"role\": \"user\",\n  \"content\": \"<a & 'b'> «°C»\",\n  \"n\": [\n    1,\n    2.5,\n    {}\n  ]\n}",
            "[]",
            r#"{"content": "<a & 'b'> \u00ab\u00b0C\u00bb", "n": [1, 2.5, {}], "role": "user"}"#,
        ]
        .join("|");
        assert_eq!(text, want);
    }

    #[test]
    fn python_methods_loop_controls_and_raise_exception_work() {
        let t = template(
            "{{ bos_token }}{% for m in messages %}{% if loop.index0 == 2 %}{% break %}{% endif %}{{ m.content.strip().upper() }};{% endfor %}",
        );
        let text = t
            .render(&[user(" a "), user("b"), user("c")], None, false)
            .unwrap();
        assert_eq!(text, "<s>A;B;");
        let t = template("{{ raise_exception('Conversation roles must alternate') }}");
        let err = t.render(&[user("x")], None, false).unwrap_err().to_string();
        assert!(
            err.starts_with("tokenizer_config.json: chat template: ")
                && err.contains("Conversation roles must alternate"),
            "{err}"
        );
        let err = t.render(&[], None, false).unwrap_err().to_string();
        assert!(err.contains("conversation"), "{err}");
    }

    #[test]
    fn a_runaway_template_runs_out_of_fuel() {
        let t = template(
            "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}",
        );
        let err = t.render(&[user("x")], None, false).unwrap_err().to_string();
        assert!(err.contains("fuel"), "{err}");
    }

    #[test]
    fn a_template_that_does_not_parse_names_its_file() {
        let err = ChatTemplate::new(
            PathBuf::from("dir/tokenizer_config.json"),
            vec![("default".into(), "{% for %}".into())],
            Vec::new(),
        )
        .err()
        .unwrap()
        .to_string();
        assert!(
            err.starts_with("dir/tokenizer_config.json: chat template: "),
            "{err}"
        );
    }

    #[test]
    fn strftime_formats_a_known_date() {
        // 2024-07-23 14:05:09 UTC, a Tuesday, day 205 of a leap year.
        let t = 1_721_743_509;
        assert_eq!(
            strftime("%d %b %Y, %A %H:%M:%S %j %y %m %B %a %%", t).unwrap(),
            "23 Jul 2024, Tuesday 14:05:09 205 24 07 July Tue %"
        );
        assert!(strftime("%Q", t).unwrap_err().to_string().contains("%Q"));
    }
}
