// Validate an AsyncAPI document with the AsyncAPI project's own parser (@asyncapi/parser).
// node tests/asyncapi_validate.cjs DOC.json  (NODE_PATH names the folder holding node_modules)
const { Parser } = require('@asyncapi/parser');
const fs = require('fs');

(async () => {
  const { document, diagnostics } = await new Parser().parse(fs.readFileSync(process.argv[2], 'utf8'));
  for (const d of diagnostics) console.log(JSON.stringify({ severity: d.severity, code: d.code, message: d.message, path: d.path }));
  if (!document || diagnostics.some((d) => d.severity === 0)) process.exit(1);
  console.log(JSON.stringify({ version: document.version(), channels: document.channels().length,
    operations: document.operations().length, messages: document.messages().length }));
})();
