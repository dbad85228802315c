//! The JSON body of a JSON route: checked as `kura_api::body` checks bodies, within the server's limits.

use axum::extract::{FromRequest, Request};
use kura_api::body::{check_json_content_type, parse_json_object, read_body};
use kura_api::ApiError;

use crate::AppState;

/// A JSON object body of a JSON route, checked as this module says.
pub struct JsonBody(pub serde_json::Value);

impl FromRequest<AppState> for JsonBody {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &AppState) -> Result<Self, ApiError> {
        check_json_content_type(req.headers())?;
        let bytes = read_body(req, state, state.body_timeout, state.max_body_bytes).await?;
        parse_json_object(&bytes).map(JsonBody)
    }
}
