//! JSON as the subcommands print it: serde_json's, with the characters a terminal or an editor
//! acts on written as `\uXXXX` escapes. serde_json escapes only what is below 0x20; DEL, the C1
//! controls (a lone U+009B is a CSI to many terminals) and the bidi controls (which reorder
//! what is shown, so a name reads as something it is not) would pass raw. Strings from other
//! processes are data (SPEC §16): the escaped JSON parses to the very same strings.

use std::borrow::Cow;
use std::fmt::Write as _;

use serde::Serialize;

/// Whether `c` is written as an escape: DEL and C1 (U+007F to U+009F), the bidi marks,
/// embeddings, overrides and isolates (U+061C, U+200E, U+200F, U+202A to U+202E, U+2066 to
/// U+2069), and the line and paragraph separators (U+2028, U+2029: line breaks to some
/// readers).
fn is_escaped(c: char) -> bool {
    matches!(
        c,
        '\u{7f}'..='\u{9f}'
            | '\u{61c}'
            | '\u{200e}'
            | '\u{200f}'
            | '\u{2028}'..='\u{202e}'
            | '\u{2066}'..='\u{2069}'
    )
}

/// `text` (JSON) with every such character as `\uXXXX`. Outside strings JSON is ASCII, so
/// every one found is inside a string, where the escape stands for the same character.
pub fn escaped(text: &str) -> Cow<'_, str> {
    if !text.chars().any(is_escaped) {
        return Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len() + 16);
    for c in text.chars() {
        if is_escaped(c) {
            // All of them are in the Basic Multilingual Plane: four hex digits.
            let _ = write!(out, "\\u{:04x}", c as u32);
        } else {
            out.push(c);
        }
    }
    Cow::Owned(out)
}

/// `value` as indented JSON, escaped.
pub fn pretty(value: &impl Serialize) -> Result<String, String> {
    let text = serde_json::to_string_pretty(value).map_err(|e| e.to_string())?;
    Ok(escaped(&text).into_owned())
}

/// `value` as one line of JSON, escaped.
pub fn line(value: &impl Serialize) -> String {
    let text = serde_json::to_string(value).unwrap_or_else(|_| "{}".into());
    escaped(&text).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn del_c1_and_bidi_are_escaped_and_parse_to_the_same_string() {
        let name = "a\u{7f}b\u{9b}31m\u{85}\u{202e}gpj.exe\u{2066}\u{200f}\u{61c}\u{2028}é\u{1b}\"";
        let text = pretty(&serde_json::json!({ "name": name })).unwrap();
        assert!(!text.chars().any(is_escaped), "{text}");
        for escape in [
            r"\u007f", r"\u009b", r"\u0085", r"\u202e", r"\u2066", r"\u200f", r"\u061c", r"\u2028",
            r"\u001b",
        ] {
            assert!(text.contains(escape), "{escape}: {text}");
        }
        // Printable non-ASCII stays as it is.
        assert!(text.contains('é'), "{text}");
        let back: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(back["name"], name);
        let one = line(&serde_json::json!([name]));
        assert!(!one.contains('\n') && !one.chars().any(is_escaped), "{one}");
        assert_eq!(serde_json::from_str::<Vec<String>>(&one).unwrap(), [name]);
        // Nothing to escape: the text as it was.
        assert!(matches!(escaped("{\"a\": \"b\"}"), Cow::Borrowed(_)));
    }
}
