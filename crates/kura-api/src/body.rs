//! Request bodies, strictly: `application/json` only (415 otherwise, so that a web page cannot drive an
//! unkeyed local server with a "simple" cross-origin POST), one JSON object and nothing after it (no
//! trailing bytes, no second object), the whole body within the body timeout (408) and the size limit
//! (413). Type errors name the field in JSON's terms. And the id in a route's path ([`PathId`]), whose
//! errors are JSON like every other.

use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{FromRequest, FromRequestParts, Path, Request};
use axum::http::request::Parts;
use axum::http::{header, HeaderMap, StatusCode};
use serde::de::DeserializeOwned;

use crate::error::ApiError;

/// The one id a route's path holds (`/v1/models/{model}`, `/v1/responses/{id}`, …). A path that does
/// not decode (percent-escapes that are not UTF-8, `%ff`) is a 400 in the API's JSON error shape.
pub struct PathId(pub String);

impl<S: Send + Sync> FromRequestParts<S> for PathId {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        match Path::<String>::from_request_parts(parts, state).await {
            Ok(Path(id)) => Ok(PathId(id)),
            Err(rejection) => Err(ApiError::invalid(
                format!("the id in the path: {}", rejection.body_text()),
                None,
            )),
        }
    }
}

/// The field names a struct reads from a JSON object (serde's own list for it): what a route's
/// body may hold besides the fields it names by hand.
pub fn fields_of<T: DeserializeOwned>() -> &'static [&'static str] {
    use serde::de::{Deserializer, Error, Visitor};

    /// A deserializer that records the fields of the struct asked of it, and gives nothing.
    struct Fields<'a>(&'a mut &'static [&'static str]);

    impl<'de> Deserializer<'de> for Fields<'_> {
        type Error = serde::de::value::Error;

        fn deserialize_any<V: Visitor<'de>>(self, _: V) -> Result<V::Value, Self::Error> {
            Err(Error::custom("a struct's fields only"))
        }

        fn deserialize_struct<V: Visitor<'de>>(
            self,
            _: &'static str,
            fields: &'static [&'static str],
            _: V,
        ) -> Result<V::Value, Self::Error> {
            *self.0 = fields;
            Err(Error::custom("fields read"))
        }

        serde::forward_to_deserialize_any! {
            bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes byte_buf
            option unit unit_struct newtype_struct seq tuple tuple_struct map enum identifier
            ignored_any
        }
    }

    let mut fields: &'static [&'static str] = &[];
    let _ = T::deserialize(Fields(&mut fields));
    fields
}

/// Refuses a body field that is none of `known`'s, naming it: a field this server does not read
/// (a misspelt one, another server's extension) is not dropped without a word.
pub fn known_fields(
    body: &serde_json::Map<String, serde_json::Value>,
    known: &[&[&str]],
    request: &str,
) -> Result<(), ApiError> {
    match unknown_field(body, known) {
        Some(k) => Err(ApiError::invalid(
            format!(
                "{k} is not a field of {request} that this server reads (docs/api-fields.md lists \
                 them)"
            ),
            None,
        )),
        None => Ok(()),
    }
}

/// The first field of `body` that none of `known`'s lists names.
fn unknown_field<'a>(
    body: &'a serde_json::Map<String, serde_json::Value>,
    known: &[&[&str]],
) -> Option<&'a String> {
    body.keys()
        .find(|k| !known.iter().any(|list| list.contains(&k.as_str())))
}

/// `Content-Type` of a JSON route: `application/json`, optionally with `charset=utf-8` (any case).
pub fn check_json_content_type(headers: &HeaderMap) -> Result<(), ApiError> {
    let given = headers.get(header::CONTENT_TYPE);
    let text = given.and_then(|v| v.to_str().ok()).unwrap_or("");
    let mut parts = text.split(';');
    let essence = parts.next().unwrap_or("").trim();
    let params_ok = parts.all(|p| {
        let p = p.trim();
        if p.is_empty() {
            return true;
        }
        match p.split_once('=') {
            Some((name, value)) if name.trim().eq_ignore_ascii_case("charset") => {
                let value = value.trim().trim_matches('"');
                value.eq_ignore_ascii_case("utf-8") || value.eq_ignore_ascii_case("utf8")
            }
            // Other parameters have no meaning for JSON; tolerate them as most servers do.
            Some(_) => true,
            None => false,
        }
    });
    if essence.eq_ignore_ascii_case("application/json") && params_ok {
        // A compressed body would be read as JSON and fail, or worse, not: say so instead.
        return match headers.get(header::CONTENT_ENCODING) {
            None => Ok(()),
            Some(v)
                if v.to_str()
                    .is_ok_and(|e| e.trim().eq_ignore_ascii_case("identity")) =>
            {
                Ok(())
            }
            Some(v) => Err(ApiError::UnsupportedMediaType(format!(
                "this server takes request bodies uncompressed, got Content-Encoding {:?}",
                String::from_utf8_lossy(v.as_bytes())
            ))),
        };
    }
    let got = match given {
        None => "no Content-Type".to_string(),
        Some(_) if text.is_empty() => "an unreadable Content-Type".to_string(),
        Some(_) => format!("Content-Type {text:?}"),
    };
    Err(ApiError::UnsupportedMediaType(format!(
        "this route takes a JSON body sent with `Content-Type: application/json` (charset utf-8), got {got}"
    )))
}

/// Friendlier wording for the untagged unions, whose serde message names only the Rust type.
fn shape_hint(path: &str) -> Option<&'static str> {
    match path {
        "prompt" => Some(
            "prompt must be a string, an array of token ids, an array of strings, or an array of token-id arrays",
        ),
        "stop" => Some("stop must be a string or an array of strings"),
        p if p.starts_with("messages") && p.ends_with("content") => Some(
            "message content must be a string or an array of {\"type\": \"text\", \"text\": ...} parts",
        ),
        _ => None,
    }
}

/// serde names Rust types ("expected i64"); clients think in JSON types, and an integer out of a
/// type's range ("invalid value: integer `2^63`, expected i64") needs the range.
fn json_type_names(message: &str) -> String {
    let mut m = message.to_string();
    for (rust, json) in [
        (
            "expected i64",
            "expected an integer from -9223372036854775808 to 9223372036854775807",
        ),
        (
            "expected i32",
            "expected an integer from -2147483648 to 2147483647",
        ),
        ("expected u32", "expected an integer from 0 to 4294967295"),
        ("expected f32", "expected a number"),
        ("expected a sequence", "expected an array"),
        ("expected a boolean", "expected true or false"),
    ] {
        m = m.replace(rust, json);
    }
    m
}

fn parse_error(e: serde_path_to_error::Error<serde_json::Error>) -> ApiError {
    let path = e.path().to_string();
    let inner = e.into_inner();
    let message = match inner.classify() {
        serde_json::error::Category::Syntax | serde_json::error::Category::Eof => {
            format!("the request body is not valid JSON: {inner}")
        }
        _ if path == "." => format!("invalid request body: {inner}"),
        // The hint only where serde's message is about a union (it names the Rust type): a field of
        // one type elsewhere (`/tokenize`'s prompt is a string) keeps serde's own words.
        _ => match shape_hint(&path).filter(|_| inner.to_string().contains("untagged enum")) {
            Some(hint) => format!("invalid value for `{path}`: {hint}"),
            None => format!(
                "invalid value for `{path}`: {}",
                json_type_names(&inner.to_string())
            ),
        },
    };
    ApiError::invalid(message, None)
}

/// A typed view of an already parsed body, with errors naming the field.
pub fn from_value<T: DeserializeOwned>(value: &serde_json::Value) -> Result<T, ApiError> {
    serde_path_to_error::deserialize(value).map_err(parse_error)
}

/// Refuses a body field outside `fields`, naming it and what `request` takes (a request whose schema
/// allows no other field).
pub fn only_fields(
    body: &serde_json::Map<String, serde_json::Value>,
    fields: &[&str],
    request: &str,
) -> Result<(), ApiError> {
    match unknown_field(body, &[fields]) {
        Some(k) => Err(ApiError::invalid(
            format!(
                "{k} is not a field of {request} (it takes {})",
                fields.join(", ")
            ),
            None,
        )),
        None => Ok(()),
    }
}

/// Exactly one JSON object, with nothing but white space after it.
pub fn parse_json_object(bytes: &[u8]) -> Result<serde_json::Value, ApiError> {
    let mut de = serde_json::Deserializer::from_slice(bytes);
    let value: serde_json::Value =
        serde_path_to_error::deserialize(&mut de).map_err(parse_error)?;
    de.end().map_err(|e| {
        ApiError::invalid(
            format!("the request body has data after its JSON object ({e}); send one object"),
            None,
        )
    })?;
    if !value.is_object() {
        return Err(ApiError::invalid(
            "the request body must be a JSON object",
            None,
        ));
    }
    Ok(value)
}

/// Reads the whole body within `timeout` and `limit_bytes`.
pub async fn read_body<S: Send + Sync>(
    req: Request,
    state: &S,
    timeout: Duration,
    limit_bytes: usize,
) -> Result<Bytes, ApiError> {
    let read = Bytes::from_request(req, state);
    let bytes = tokio::time::timeout(timeout, read)
        .await
        .map_err(|_| ApiError::BodyTimeout {
            seconds: timeout.as_secs_f64(),
        })?;
    bytes.map_err(|rejection| {
        if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::BodyTooLarge { limit_bytes }
        } else {
            ApiError::invalid(
                format!("could not read the request body: {}", rejection.body_text()),
                None,
            )
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    fn headers(ct: Option<&str>) -> HeaderMap {
        let mut h = HeaderMap::new();
        if let Some(ct) = ct {
            h.insert(header::CONTENT_TYPE, HeaderValue::from_str(ct).unwrap());
        }
        h
    }

    #[test]
    fn only_json_content_types_are_accepted() {
        for ok in [
            "application/json",
            "Application/JSON",
            "application/json; charset=utf-8",
            "application/json;charset=\"UTF-8\"",
        ] {
            assert!(check_json_content_type(&headers(Some(ok))).is_ok(), "{ok}");
        }
        for bad in [
            None,
            Some("text/plain"),
            Some("application/x-www-form-urlencoded"),
            Some("multipart/form-data; boundary=x"),
            Some("application/json; charset=latin1"),
            Some("application/jsonx"),
            Some(""),
        ] {
            let e = check_json_content_type(&headers(bad)).unwrap_err();
            assert_eq!(e.status(), StatusCode::UNSUPPORTED_MEDIA_TYPE, "{bad:?}");
            assert!(e.to_string().contains("application/json"), "{e}");
        }
    }

    #[test]
    fn a_compressed_body_is_refused_by_its_encoding() {
        let mut h = headers(Some("application/json"));
        h.insert(
            header::CONTENT_ENCODING,
            HeaderValue::from_static("identity"),
        );
        assert!(check_json_content_type(&h).is_ok());
        for enc in ["gzip", "br", "deflate, gzip"] {
            h.insert(header::CONTENT_ENCODING, HeaderValue::from_static(enc));
            let e = check_json_content_type(&h).unwrap_err();
            assert_eq!(e.status(), StatusCode::UNSUPPORTED_MEDIA_TYPE, "{enc}");
            assert!(e.to_string().contains(enc), "{e}");
        }
    }

    #[test]
    fn one_object_and_nothing_after_it() {
        assert!(parse_json_object(br#" {"a": 1} "#).is_ok());
        assert!(parse_json_object(b"{\"a\": 1}\n\t").is_ok());
        for bad in [
            &br#"{"a": 1} x"#[..],
            br#"{"a": 1}{"b": 2}"#,
            b"{\"a\": 1}\0",
            br#"[1]"#,
            b"",
            br#"{"a": "#,
        ] {
            let e = parse_json_object(bad).unwrap_err();
            assert_eq!(e.status(), StatusCode::BAD_REQUEST, "{bad:?}");
        }
        let e = parse_json_object(br#"{"a": 1}{"b": 2}"#).unwrap_err();
        assert!(e.to_string().contains("data after its JSON object"), "{e}");
    }

    #[tokio::test]
    async fn a_path_id_that_does_not_decode_is_a_json_400() {
        use tower::ServiceExt;
        let app = axum::Router::new().route(
            "/r/{id}",
            axum::routing::get(|PathId(id): PathId| async move { id }),
        );
        let get = |uri: &'static str| {
            let req = Request::builder()
                .uri(uri)
                .body(axum::body::Body::empty())
                .unwrap();
            app.clone().oneshot(req)
        };
        let body = |r: axum::response::Response| axum::body::to_bytes(r.into_body(), 1 << 16);
        let ok = get("/r/resp_%41").await.unwrap();
        assert_eq!(ok.status(), StatusCode::OK);
        assert_eq!(&body(ok).await.unwrap()[..], b"resp_A");
        let bad = get("/r/resp_%ff").await.unwrap();
        assert_eq!(bad.status(), StatusCode::BAD_REQUEST);
        let error: serde_json::Value = serde_json::from_slice(&body(bad).await.unwrap()).unwrap();
        let message = error["error"]["message"].as_str().unwrap();
        assert!(message.starts_with("the id in the path: "), "{error}");
    }
}
