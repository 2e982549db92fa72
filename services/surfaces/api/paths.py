"""The API's path prefixes, which every surface module's `ROUTES` builds on."""

from __future__ import annotations

V1 = "/api/v1"
ORG = V1 + "/orgs/{org}"
RUN = ORG + "/runs/{run}"
WS = ORG + "/workspaces/{ws}"
