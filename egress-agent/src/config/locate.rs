//! Where a configuration error is: TOML parse errors and validation errors as
//! file:line:column: field, in the main file or the `policies.d` file the field came from.
use std::collections::BTreeMap;
use std::ops::Range;
use std::path::{Path, PathBuf};

use egress_policy::ValidationError;

use super::ConfigError;

/// Where the text of a configuration came from: the main file, and the `policies.d` files by
/// policy name. Validation errors name the file their field is in.
pub(crate) struct Sources<'a> {
    pub main: (&'a Path, &'a str),
    pub files: BTreeMap<String, (PathBuf, String)>,
}

impl<'a> Sources<'a> {
    pub fn main(path: &'a Path, text: &'a str) -> Self {
        Sources {
            main: (path, text),
            files: BTreeMap::new(),
        }
    }

    /// A validation error as a located configuration error.
    pub fn locate(&self, v: ValidationError) -> ConfigError {
        let in_file = v.field.strip_prefix("policies.").and_then(|rest| {
            let name = rest.split(['.', '[']).next()?;
            let (path, text) = self.files.get(name)?;
            let inner = rest[name.len()..].trim_start_matches('.');
            Some((path.as_path(), text.as_str(), inner))
        });
        let (path, text, at) = match in_file {
            Some((path, text, inner)) => (path, text, inner),
            None => (self.main.0, self.main.1, v.field.as_str()),
        };
        let (line, column) = if at.is_empty() {
            (1, 1)
        } else {
            span_of_path(text, at)
                .map(|r| line_col(text, r.start))
                .unwrap_or((0, 0))
        };
        ConfigError::Invalid {
            path: path.to_owned(),
            line,
            column,
            field: v.field,
            message: v.message,
        }
    }
}

/// Parse TOML text into `T`, locating errors: file:line:column, and the field as `prefix` + its
/// dotted path (`policies.ci.` for a `policies.d/ci.toml` file).
pub(crate) fn parse_located<T: serde::de::DeserializeOwned>(
    s: &str,
    origin: &Path,
    prefix: &str,
) -> Result<T, ConfigError> {
    toml::from_str(s).map_err(|e| {
        let located = e.span().and_then(|r| field_at(s, r, e.message()));
        let start = located
            .as_ref()
            .map(|(_, r)| r.start)
            .or(e.span().map(|r| r.start));
        let (line, column) = start.map(|o| line_col(s, o)).unwrap_or((0, 0));
        let field = located.map(|(f, _)| f).unwrap_or_else(|| {
            // E.g. a duplicate key, where the document can't be re-parsed: name the text.
            e.span()
                .and_then(|r| s.get(r))
                .filter(|t| !t.is_empty() && t.len() <= 64 && !t.contains('\n'))
                .unwrap_or("-")
                .to_owned()
        });
        ConfigError::Invalid {
            path: origin.to_owned(),
            line,
            column,
            field: format!("{prefix}{field}"),
            message: e.message().trim().to_owned(),
        }
    })
}

pub(super) fn line_col(s: &str, offset: usize) -> (usize, usize) {
    let offset = offset.min(s.len());
    let before = &s[..offset];
    let line = before.matches('\n').count() + 1;
    let column = before.rfind('\n').map_or(offset, |nl| offset - nl - 1) + 1;
    (line, column)
}

/// The dotted key path at `span` in `s` and its span (best effort, for parse errors). An error on
/// a whole array whose message quotes one of its string items is narrowed to that item.
fn field_at(s: &str, span: Range<usize>, message: &str) -> Option<(String, Range<usize>)> {
    type Best = Option<(String, Range<usize>)>;
    fn walk(
        t: &toml::de::DeTable<'_>,
        prefix: &str,
        span: &Range<usize>,
        msg: &str,
        best: &mut Best,
    ) {
        for (k, v) in t.iter() {
            let path = if prefix.is_empty() {
                k.get_ref().to_string()
            } else {
                format!("{prefix}.{}", k.get_ref())
            };
            let ks = k.span();
            if ks.start <= span.start && span.start < ks.end.max(ks.start + 1) {
                *best = Some((path.clone(), ks));
            }
            visit(v, &path, span, msg, best);
        }
    }
    fn visit(
        v: &toml::Spanned<toml::de::DeValue<'_>>,
        path: &str,
        span: &Range<usize>,
        msg: &str,
        best: &mut Best,
    ) {
        let vs = v.span();
        if vs.start <= span.start && span.start < vs.end.max(vs.start + 1) {
            let narrower = best
                .as_ref()
                .is_none_or(|(_, b)| vs.end - vs.start <= b.end - b.start);
            if narrower {
                *best = Some((path.to_owned(), vs.clone()));
            }
        }
        match v.get_ref() {
            toml::de::DeValue::Table(t) => walk(t, path, span, msg, best),
            toml::de::DeValue::Array(a) => {
                let whole = vs == *span;
                for (i, item) in a.iter().enumerate() {
                    let item_path = format!("{path}[{i}]");
                    if whole
                        && let toml::de::DeValue::String(sv) = item.get_ref()
                        && msg.contains(&format!("{:?}", sv.as_ref()))
                    {
                        *best = Some((item_path, item.span()));
                        return;
                    }
                    visit(item, &item_path, span, msg, best);
                }
            }
            _ => {}
        }
    }
    let doc = toml::de::DeTable::parse(s).ok()?;
    let mut best: Best = None;
    walk(doc.get_ref(), "", &span, message, &mut best);
    best
}

/// The span of a dotted path like `policies.ci.deny_cidrs[1]` (or its nearest existing parent).
pub(super) fn span_of_path(s: &str, path: &str) -> Option<Range<usize>> {
    let doc = toml::de::DeTable::parse(s).ok()?;
    let mut table = doc.get_ref();
    let mut found: Option<Range<usize>> = None;
    let segs: Vec<&str> = path.split('.').collect();
    for (n, seg) in segs.iter().enumerate() {
        let (key, index) = match seg.split_once('[') {
            Some((k, rest)) => (k, rest.trim_end_matches(']').parse::<usize>().ok()),
            None => (*seg, None),
        };
        let Some((k, v)) = table.iter().find(|(k, _)| k.get_ref().as_ref() == key) else {
            break;
        };
        found = Some(k.span());
        let mut value = v;
        if let (Some(i), toml::de::DeValue::Array(a)) = (index, v.get_ref())
            && let Some(item) = a.get(i)
        {
            found = Some(item.span());
            value = item;
        }
        match value.get_ref() {
            toml::de::DeValue::Table(t) if n + 1 < segs.len() => table = t,
            _ => break,
        }
    }
    found
}
