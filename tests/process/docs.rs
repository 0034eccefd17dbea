//! The user-facing docs (README.md, docs/*.md) say only what is true of this checkout: the
//! README's shape (its length, its first command, its pictures current), every chart's data equal
//! to the table it is drawn from, every figure quoted equal to the benchmark tables, and every
//! variable, subcommand, flag, test file and link the pages name existing.

use crate::common;

use std::collections::BTreeSet;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use common::*;

const README_MAX_LINES: usize = 350;

fn read(path: &Path) -> String {
    fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// README.md and every docs/*.md, with their paths relative to the repository.
fn pages() -> Vec<(String, String)> {
    let mut names = vec!["README.md".to_string()];
    let mut docs: Vec<String> = fs::read_dir(repo().join("docs"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|name| name.ends_with(".md"))
        .map(|name| format!("docs/{name}"))
        .collect();
    docs.sort();
    names.extend(docs);
    names.push("docs/monitoring/README.md".to_string());
    names
        .into_iter()
        .map(|name| {
            let text = read(&repo().join(&name));
            (name, text)
        })
        .collect()
}

/// The fenced code blocks of a page: (info string, body).
fn code_blocks(text: &str) -> Vec<(String, String)> {
    let mut blocks = Vec::new();
    let mut open: Option<(String, String)> = None;
    for line in text.lines() {
        let fence = line.trim_start().starts_with("```");
        match open.as_mut() {
            None if fence => {
                open = Some((
                    line.trim().trim_start_matches('`').to_string(),
                    String::new(),
                ))
            }
            Some(_) if fence => blocks.extend(open.take()),
            Some((_, body)) => {
                body.push_str(line);
                body.push('\n');
            }
            None => {}
        }
    }
    blocks
}

/// Every `[text](target)` and `![alt](target)` of a page outside code blocks.
fn links(text: &str) -> Vec<String> {
    let mut found = Vec::new();
    let mut in_code = false;
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            in_code = !in_code;
            continue;
        }
        if in_code {
            continue;
        }
        let mut rest = line;
        while let Some(at) = rest.find("](") {
            let after = &rest[at + 2..];
            match after.find(')') {
                Some(end) => {
                    found.push(after[..end].to_string());
                    rest = &after[end..];
                }
                None => break,
            }
        }
    }
    found
}

/// GitHub's anchor for a heading: lower case, punctuation but `-` and `_` dropped, spaces to `-`.
fn anchor(heading: &str) -> String {
    // A link in a heading counts by its text: `## Roles ([reference](reference.md))`.
    let mut text = String::new();
    let mut rest = heading;
    while let Some(open) = rest.find("](") {
        text.push_str(&rest[..open]);
        rest = rest[open..].split_once(')').map_or("", |(_, after)| after);
    }
    text.push_str(rest);
    text.trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || *c == ' ' || *c == '-' || *c == '_')
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

fn anchors(text: &str) -> BTreeSet<String> {
    let mut in_code = false;
    let mut found = BTreeSet::new();
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            in_code = !in_code;
        } else if !in_code && line.starts_with('#') {
            found.insert(anchor(line.trim_start_matches('#')));
        }
    }
    found
}

/// The rows of the first markdown table after the line `heading` of a page.
fn table_after(text: &str, heading: &str) -> Vec<Vec<String>> {
    let lines: Vec<&str> = text.lines().collect();
    let start = lines
        .iter()
        .position(|l| *l == heading)
        .unwrap_or_else(|| panic!("no heading {heading:?}"));
    let mut rows = Vec::new();
    for line in &lines[start + 1..] {
        if line.starts_with('#') {
            break;
        }
        if line.starts_with('|') {
            let cells: Vec<String> = line
                .trim()
                .trim_matches('|')
                .split('|')
                .map(|c| c.trim().to_string())
                .collect();
            if !cells.iter().all(|c| c.chars().all(|ch| "-: ".contains(ch))) {
                rows.push(cells);
            }
        } else if !rows.is_empty() {
            break;
        }
    }
    assert!(!rows.is_empty(), "no table after {heading:?}");
    rows.split_off(1)
}

/// The first number of a cell: `1.89 (1.82–1.94)` → 1.89, `+763` → 763.
fn first_number(cell: &str) -> Option<f64> {
    let start = cell.find(|c: char| c.is_ascii_digit())?;
    let digits: String = cell[start..]
        .chars()
        .take_while(|c| c.is_ascii_digit() || *c == '.')
        .collect();
    digits.trim_end_matches('.').parse().ok()
}

#[test]
fn readme_is_short_starts_with_the_demo_and_its_pictures_exist() {
    let readme = read(&repo().join("README.md"));
    let lines = readme.lines().count();
    assert!(
        lines <= README_MAX_LINES,
        "README.md has {lines} lines, more than {README_MAX_LINES}: move detail to docs/"
    );
    let blocks = code_blocks(&readme);
    let (info, first) = blocks.first().expect("README.md has no code block");
    assert_eq!(
        (info.as_str(), first.trim()),
        ("sh", "scripts/demo"),
        "README.md's first code block must be the demo"
    );
    let images: Vec<String> = readme
        .match_indices("![")
        .filter_map(|(at, _)| {
            let rest = &readme[at..];
            let open = rest.find("](")?;
            let close = rest[open..].find(')')?;
            Some(rest[open + 2..open + close].to_string())
        })
        .collect();
    assert!(!images.is_empty(), "README.md shows no chart");
    for image in &images {
        assert!(
            repo().join(image).is_file(),
            "README.md shows {image}, which does not exist"
        );
    }
    // Current: the charts are what scripts/charts draws from the tables now.
    let check = Command::new("python3")
        .arg(repo().join("scripts/charts"))
        .arg("--check")
        .output()
        .unwrap();
    assert!(
        check.status.success(),
        "{}",
        String::from_utf8_lossy(&check.stderr)
    );
    // The two commands a newcomer needs stay visible: the main job and the full test run.
    for command in ["scripts/demo", "scripts/test"] {
        assert!(
            blocks.iter().any(|(_, body)| body.trim() == command),
            "README.md has no block that is just `{command}`"
        );
    }
}

/// Each chart's embedded data equals the cell of the table it names, read here independently of
/// scripts/charts.
#[test]
fn every_chart_shows_the_numbers_of_its_table() {
    let charts = repo().join("docs/charts");
    let mut seen = 0;
    for entry in fs::read_dir(&charts).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_none_or(|e| e != "svg") {
            continue;
        }
        let svg = read(&path);
        let meta = svg
            .split("<metadata id=\"chart-data\">")
            .nth(1)
            .and_then(|rest| rest.split("</metadata>").next())
            .unwrap_or_else(|| panic!("{}: no chart-data metadata", path.display()));
        let meta = meta
            .replace("&lt;", "<")
            .replace("&gt;", ">")
            .replace("&amp;", "&");
        let items: Vec<serde_json::Value> = serde_json::from_str(&meta).unwrap();
        assert!(!items.is_empty(), "{}: no data", path.display());
        for item in items {
            let doc = read(&repo().join(item["doc"].as_str().unwrap()));
            let rows = table_after(&doc, item["section"].as_str().unwrap());
            let label = item["row"].as_str().unwrap();
            let matching: Vec<&Vec<String>> = rows.iter().filter(|r| r[0] == label).collect();
            assert!(
                !matching.is_empty(),
                "{}: no row {label:?} in {} {}",
                path.display(),
                item["doc"],
                item["section"]
            );
            if let Some(column) = item["column"].as_u64() {
                let cell = &matching[0][column as usize];
                assert_eq!(
                    cell,
                    item["cell"].as_str().unwrap(),
                    "{}: row {label:?}",
                    path.display()
                );
                assert_eq!(
                    first_number(cell),
                    item["value"].as_f64(),
                    "{}: row {label:?}: the bar is not the cell's number",
                    path.display()
                );
            } else {
                // The tray: one row per GPU, every column drawn.
                let gpu = item["gpu"].as_str().unwrap();
                let row = matching
                    .iter()
                    .find(|r| r[3] == gpu)
                    .unwrap_or_else(|| panic!("{}: no row for GPU {gpu}", path.display()));
                for (key, column) in [
                    ("pci", 4),
                    ("numa_node", 5),
                    ("memory_node", 6),
                    ("workers", 7),
                    ("step", 8),
                    ("result", 9),
                ] {
                    assert_eq!(
                        item[key].as_str().unwrap(),
                        row[column],
                        "{}: GPU {gpu}'s {key}",
                        path.display()
                    );
                    assert!(
                        svg.contains(&row[column]),
                        "{}: GPU {gpu}'s {key} {} is not drawn",
                        path.display(),
                        row[column]
                    );
                }
            }
        }
        seen += 1;
    }
    assert!(seen >= 4, "only {seen} charts in docs/charts");
}

/// A ratio (`1.89×`) or an instruction count (`+763`) that the README, the how-to pages or the
/// reference quote is a cell of the benchmark tables: the latest run's targets, the server's
/// summary and the slices' ratios in the guest.
#[test]
fn figures_quoted_are_the_benchmark_tables() {
    let benchmarks = read(&repo().join("docs/benchmarks.md"));
    let mut source: Vec<f64> = Vec::new();
    for heading in [
        "## Latest run: the targets",
        "## What it buys: a real server",
        "### Slices against node masks in the guest, per round",
    ] {
        for row in table_after(&benchmarks, heading) {
            source.extend(row.iter().skip(1).filter_map(|c| first_number(c)));
        }
    }
    let mut wrong = Vec::new();
    for page in [
        "README.md",
        "docs/recipes.md",
        "docs/monitoring.md",
        "docs/faq.md",
        "docs/reference.md",
    ] {
        let text = read(&repo().join(page));
        for (at, _) in text.match_indices('×') {
            let before = &text[..at];
            let start = before
                .char_indices()
                .rev()
                .find(|(_, c)| !(c.is_ascii_digit() || *c == '.'))
                .map_or(0, |(i, c)| i + c.len_utf8());
            // `8×H100` is a count of GPUs, not a figure.
            let names_a_thing =
                text[at + '×'.len_utf8()..].starts_with(|c: char| c.is_ascii_alphanumeric());
            if let Ok(value) = before[start..].parse::<f64>() {
                if !names_a_thing && !source.contains(&value) {
                    wrong.push(format!("{page}: {value}×"));
                }
            }
        }
        // Instruction counts over glibc's are quoted as `+763`; `U+2028` names a character.
        for (at, _) in text.match_indices('+') {
            if text[..at].ends_with('U') {
                continue;
            }
            let digits: String = text[at + 1..]
                .chars()
                .take_while(|c| c.is_ascii_digit())
                .collect();
            if digits.len() >= 3 && !source.contains(&digits.parse::<f64>().unwrap()) {
                wrong.push(format!("{page}: +{digits}"));
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "figures not in docs/benchmarks.md's latest tables: {wrong:?}"
    );
}

/// Every relative link of every page leads to a file that exists, and to a heading it has.
#[test]
fn every_link_leads_somewhere() {
    let mut broken = Vec::new();
    for (name, text) in pages() {
        let dir = repo().join(&name).parent().unwrap().to_path_buf();
        for link in links(&text) {
            if link.starts_with("http") || link.starts_with("mailto:") {
                continue;
            }
            let (file, fragment) = link.split_once('#').unwrap_or((link.as_str(), ""));
            let target: PathBuf = if file.is_empty() {
                repo().join(&name)
            } else {
                dir.join(file)
            };
            if !target.exists() {
                broken.push(format!("{name}: {link} (no such file)"));
                continue;
            }
            if !fragment.is_empty()
                && target.is_file()
                && !anchors(&read(&target)).contains(fragment)
            {
                broken.push(format!("{name}: {link} (no such heading)"));
            }
        }
    }
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
}

/// Every source file of the project, as one text to search in.
fn all_sources() -> String {
    let mut text = String::new();
    let mut stack = vec![
        repo().join("src"),
        repo().join("cli/src"),
        repo().join("cdylib"),
        repo().join("python"),
        repo().join("tests"),
        repo().join("scripts"),
    ];
    while let Some(dir) = stack.pop() {
        for entry in fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                stack.push(path);
            } else if path
                .extension()
                .is_some_and(|e| ["rs", "py", "c", "h", "sh"].contains(&e.to_str().unwrap()))
                || path.parent().unwrap().ends_with("scripts")
            {
                text.push_str(&fs::read_to_string(&path).unwrap_or_default());
            }
        }
    }
    text
}

/// The words of the pages that look like `prefix` followed by name characters.
fn names_with_prefix(text: &str, prefix: &str) -> BTreeSet<String> {
    text.match_indices(prefix)
        .map(|(at, _)| {
            text[at..]
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || "_-/*".contains(*c))
                .collect::<String>()
        })
        .map(|s| s.trim_end_matches(['_', '-', '/']).to_string())
        .collect()
}

#[test]
fn every_variable_and_test_file_the_docs_name_exists() {
    let sources = all_sources();
    let mut missing = Vec::new();
    for (name, text) in pages() {
        for variable in names_with_prefix(&text, "TLLM_AFFINITY_") {
            if variable.ends_with('*') || variable == "TLLM_AFFINITY_" {
                continue;
            }
            if !sources.contains(&variable) {
                missing.push(format!("{name}: variable {variable}"));
            }
        }
        for file in names_with_prefix(&text, "tests/") {
            // `tests/guest/drive` names tests/guest/drive.py: a file of that stem.
            let path = repo().join(&file);
            // `tests/programs/deploy_*.py`: a file that starts so.
            let stem_exists = || {
                let stem = path.file_name().unwrap().to_string_lossy().into_owned();
                fs::read_dir(path.parent().unwrap()).is_ok_and(|entries| {
                    entries.flatten().any(|e| {
                        let name = e.file_name().to_string_lossy().into_owned();
                        match stem.split_once('*') {
                            Some((start, _)) => name.starts_with(start),
                            None => name.split_once('.').is_some_and(|(s, _)| s == stem),
                        }
                    })
                })
            };
            let exists = path.exists() || stem_exists();
            if !exists {
                missing.push(format!("{name}: {file}"));
            }
        }
        for (_, body) in code_blocks(&text) {
            for line in body.lines() {
                // `--test TIER -- MODULE::`: a tier binary (tests/TIER/main.rs) and its module.
                if let Some(after) = line.split("--test ").nth(1) {
                    let mut words = after.split_whitespace();
                    let tier = words.next().unwrap_or_default();
                    let is_name =
                        |w: &str| w.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
                    if tier.is_empty() || !is_name(tier) {
                        continue;
                    }
                    if !repo().join(format!("tests/{tier}/main.rs")).exists() {
                        missing.push(format!("{name}: cargo test --test {tier}"));
                        continue;
                    }
                    let module = words
                        .skip_while(|w| *w != "--")
                        .nth(1)
                        .and_then(|w| w.strip_suffix("::"));
                    if let Some(module) = module.filter(|m| is_name(m)) {
                        if !repo().join(format!("tests/{tier}/{module}.rs")).exists() {
                            missing.push(format!("{name}: cargo test --test {tier} -- {module}::"));
                        }
                    }
                }
            }
        }
    }
    assert!(
        missing.is_empty(),
        "named but not in the code:\n{}",
        missing.join("\n")
    );
}

/// `tllm-affinity SUB --flag` as the pages show it: every subcommand is one the command has, and
/// every flag before the program's own `--` is in that subcommand's `--help`.
#[test]
fn every_subcommand_and_flag_the_docs_show_exists() {
    let help = |args: &[&str]| -> String {
        let out = Command::new(cli())
            .args(args)
            .arg("--help")
            .output()
            .unwrap();
        assert!(out.status.success(), "tllm-affinity {args:?} --help failed");
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let top = help(&[]);
    let subcommands: BTreeSet<String> = top
        .split("Commands:")
        .nth(1)
        .unwrap()
        .split("Options:")
        .next()
        .unwrap()
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .map(str::to_string)
        .collect();
    let mut wrong = Vec::new();
    let mut checked = 0;
    for (name, text) in pages() {
        // In code blocks and in inline code alike, line by line.
        let mut snippets: Vec<String> = code_blocks(&text)
            .into_iter()
            .flat_map(|(_, body)| body.lines().map(str::to_string).collect::<Vec<_>>())
            .collect();
        let prose: String = text.split("```").step_by(2).collect::<Vec<_>>().join("\n");
        snippets.extend(
            prose
                .split('`')
                .skip(1)
                .step_by(2)
                .flat_map(|s| s.lines().map(str::to_string).collect::<Vec<_>>()),
        );
        for snippet in snippets {
            for (at, _) in snippet.match_indices("tllm-affinity ") {
                // `pip uninstall tllm-affinity`, `/usr/local/bin/tllm-affinity`, paths: only the
                // command in a command's position.
                let before = snippet[..at].trim_end();
                if !(before.is_empty()
                    || before.ends_with(['$', '&', '|', ';', '(', '#'])
                    || before.ends_with("ExecStart=/usr/local/bin/")
                    || before.split_whitespace().last().is_some_and(|w| {
                        w.contains('=') || ["env", "sudo", "timeout", "exec"].contains(&w)
                    }))
                {
                    continue;
                }
                let words: Vec<&str> = snippet[at + "tllm-affinity ".len()..]
                    .split_whitespace()
                    .take_while(|w| *w != "--" && *w != "|" && *w != "&&" && *w != "#")
                    .collect();
                let Some(sub) = words.first() else { continue };
                // Placeholders (`SUBCOMMAND`), options, file names.
                if sub.starts_with('-')
                    || sub.starts_with('<')
                    || sub.contains('.')
                    || sub.chars().all(|c| c.is_ascii_uppercase())
                {
                    continue;
                }
                let sub = sub.trim_matches(['`', ',', ')', ':']);
                if !subcommands.contains(sub) {
                    wrong.push(format!("{name}: subcommand {sub:?} in {snippet:?}"));
                    continue;
                }
                let sub_help = help(&[sub]);
                for flag in words.iter().skip(1).filter(|w| w.starts_with("--")) {
                    let flag = flag
                        .split('=')
                        .next()
                        .unwrap()
                        .trim_matches(['`', ',', ')', ':', '.', ';']);
                    if flag.len() > 2 && !sub_help.contains(flag) {
                        wrong.push(format!("{name}: {sub} {flag} in {snippet:?}"));
                    }
                    checked += 1;
                }
            }
        }
    }
    assert!(checked > 20, "only {checked} flags found in the docs");
    assert!(
        wrong.is_empty(),
        "not in the command:\n{}",
        wrong.join("\n")
    );
}

#[test]
fn anchors_are_githubs() {
    assert_eq!(anchor(" `srun --cpu-bind`"), "srun---cpu-bind");
    assert_eq!(
        anchor("No GPU here? A simulated host"),
        "no-gpu-here-a-simulated-host"
    );
    assert_eq!(
        anchor("Tested on real kernels — `tests/guests/guest.rs`"),
        "tested-on-real-kernels--testsguestsguestrs"
    );
    assert_eq!(first_number("1.89 (1.82–1.94)"), Some(1.89));
    assert_eq!(first_number("**245 MiB/s**"), Some(245.0));
}

/// Names of other projects' functions and metrics that the docs name in backticks.
const OTHER_PROJECTS_NAMES: [&str; 2] = ["omp_set_num_threads", "openblas_set_num_threads"];

/// A test, function or metric name in backticks (`snake_case` of four words or more, as
/// `device_check_script_against_the_double`) is in the code, the tests or the monitoring files.
#[test]
fn every_test_and_function_name_the_docs_show_exists() {
    let mut sources = all_sources();
    for file in ["rules.yml", "rules_test.yml", "dashboard.json"] {
        sources.push_str(&read(&repo().join("docs/monitoring").join(file)));
    }
    sources.push_str(&read(&repo().join("include/tllm_affinity.h")));
    let mut missing = Vec::new();
    let mut checked = 0;
    for (name, text) in pages() {
        for word in text.split('`').skip(1).step_by(2) {
            let is_name = word.split('_').count() >= 4
                && word.starts_with(|c: char| c.is_ascii_lowercase())
                && word
                    .chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
            if !is_name || OTHER_PROJECTS_NAMES.contains(&word) {
                continue;
            }
            checked += 1;
            if !sources.contains(word) {
                missing.push(format!("{name}: {word}"));
            }
        }
    }
    assert!(checked > 20, "only {checked} names found in the docs");
    assert!(
        missing.is_empty(),
        "named but not in the code:\n{}",
        missing.join("\n")
    );
}
