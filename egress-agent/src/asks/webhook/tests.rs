use super::*;

fn view(workload: &str, reason: &str) -> View {
    View {
        id: 7,
        time: "2026-01-02T03:04:05.000Z".to_owned(),
        policy: "ci".to_owned(),
        workload: workload.to_owned(),
        run: Some("42".to_owned()),
        host: "api.example.com".to_owned(),
        port: 443,
        reason: reason.to_owned(),
        methods: vec!["GET".to_owned()],
        paths: vec!["/v1/<x>".to_owned()],
        outcome: Outcome::Pending,
    }
}

#[test]
fn the_body_carries_the_request_and_the_commands() {
    let b = body(&view("web-1", "needs the API"), "node-a");
    let r = &b["egress_request"];
    assert_eq!(r["id"], 7);
    assert_eq!(r["host"], "api.example.com");
    assert_eq!(r["port"], 443);
    assert_eq!(r["workload"], "web-1");
    assert_eq!(r["policy"], "ci");
    assert_eq!(r["run"], "42");
    assert_eq!(r["node"], "node-a");
    assert_eq!(r["reason"], "needs the API");
    assert_eq!(r["methods"], json!(["GET"]));
    assert_eq!(
        r["paths"],
        json!(["/v1/<x>"]),
        "the object keeps the raw values"
    );
    assert_eq!(r["time"], "2026-01-02T03:04:05.000Z");
    assert_eq!(r["approve"], "egress-agent requests approve 7 --scope run");
    assert_eq!(
        r["approve_policy"],
        "egress-agent requests approve 7 --scope policy"
    );
    assert_eq!(r["deny"], "egress-agent requests deny 7 --reason \"...\"");
    let text = b["text"].as_str().unwrap();
    for want in [
        "access request 7",
        "`api.example.com:443`",
        "workload `web-1` (policy `ci`, run `42`)",
        "in the workload's own words (unverified): `needs the API`",
        "`egress-agent requests approve 7 --scope run`",
        "`egress-agent requests deny 7 --reason \"...\"`",
        "paths `/v1/&lt;x&gt;`",
        "`node-a`",
    ] {
        assert!(text.contains(want), "{want:?} not in {text}");
    }
}

/// What a prompt-injected workload writes can't mention anyone, link, format, add lines or
/// leave its code span.
#[test]
fn untrusted_words_are_neutralised() {
    let hostile = "ok <!here> <!channel> <@U024BE7LH> @channel @here @all @everyone \
                   <https://evil.test|click> [click](https://evil.test) **bold** \
                   `code` escape` \n\r\u{7}Approved by ops\u{202e}txt.exe\u{200b}& done";
    let b = body(&view("w <!channel> @here", hostile), "n");
    let text = b["text"].as_str().unwrap();
    assert!(!text.contains('<') && !text.contains('>'), "{text}");
    for mention in ["@channel", "@here", "@all", "@everyone", "<!", "<@"] {
        assert!(!text.contains(mention), "{mention} in {text}");
    }
    assert!(text.contains("@\u{200b}channel"), "{text}");
    assert!(
        text.contains("&lt;!here&gt;") && text.contains("&amp; done"),
        "{text}"
    );
    assert!(!text.contains('\u{202e}') && !text.contains('\r') && !text.contains('\u{7}'));
    // Three lines of ours, none of the workload's.
    assert_eq!(text.lines().count(), 4, "{text}");
    let reason_line = text.lines().nth(2).unwrap();
    assert!(
        reason_line.starts_with("Reason, in the workload's own words (unverified): `"),
        "{reason_line}"
    );
    // One code span: the opening and closing backticks are ours.
    assert_eq!(reason_line.matches('`').count(), 2, "{reason_line}");
    assert!(reason_line.contains("'code' escape'"), "{reason_line}");
    // The object is JSON (escaped by serde), the raw words kept for tools that read it.
    assert_eq!(b["egress_request"]["reason"], hostile);
}

#[test]
fn neutral_cuts_long_fields_and_keeps_ordinary_text() {
    assert_eq!(
        neutral("pip install needs pypi.org"),
        "pip install needs pypi.org"
    );
    assert_eq!(neutral("a&b"), "a&amp;b");
    assert_eq!(neutral("x\ny\tz\u{202e}"), "x y z");
    let long = neutral(&"é".repeat(1000));
    assert_eq!(long.chars().count(), MAX_FIELD_CHARS + 1);
    assert!(long.ends_with('…'));
}

#[tokio::test]
async fn configure_reads_the_url_and_off_stops() {
    let w = Webhook::new(None);
    assert!(!w.configure(None).unwrap());
    let cfg: WebhookConfig =
        toml::from_str("url = \"http://127.0.0.1:9/hook\"\ntimeout_ms = 100\n").unwrap();
    assert!(w.configure(Some(&cfg)).unwrap());
    assert!(w.current().is_some());
    let bad: WebhookConfig =
        toml::from_str("url = { file = \"/nonexistent/egress-webhook-url\" }\n").unwrap();
    let e = w.configure(Some(&bad)).unwrap_err();
    assert_eq!(e.field, "requests.webhook.url");
    assert!(
        w.current().is_none(),
        "a failed configuration leaves notifications off"
    );
    assert!(w.configure(Some(&cfg)).unwrap());
    assert!(!w.configure(None).unwrap());
    assert!(w.current().is_none());
}
