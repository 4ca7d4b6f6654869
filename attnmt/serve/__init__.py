"""`attnmt serve`: translation over HTTP. The request schema and limits (schema), one request
from its bytes to its answer (requests), the step-level scheduler (scheduler), the app and its
routes (app), the socket, signals and middleware around it (http), and the page
(web/index.html). Imports decoding and what is below it; it repeats none of its checks.
"""
