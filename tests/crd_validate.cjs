// Validate KEDA and Strimzi custom resources with validators generated from their CRDs
// (@kubernetes-models/keda, @kubernetes-models/strimzi-kafka-operator; ES modules).
// node tests/crd_validate.cjs NODE_MODULES DOCS.json  (DOCS.json: a JSON array of resources).
// One JSON line per resource: {kind, name, error}; error is null when valid.
const fs = require('fs');
const path = require('path');
const { pathToFileURL } = require('url');

const PACKAGES = { 'keda.sh': '@kubernetes-models/keda', 'kafka.strimzi.io': '@kubernetes-models/strimzi-kafka-operator' };

(async () => {
  const [modules, docs] = process.argv.slice(2);
  for (const doc of JSON.parse(fs.readFileSync(docs, 'utf8'))) {
    const [group, version] = doc.apiVersion.split('/');
    // by file: the packages export these modules to `import` only, not to a script outside their tree
    const file = path.join(modules, PACKAGES[group], group, version, `${doc.kind}.js`);
    const model = (await import(pathToFileURL(file).href))[doc.kind];
    let error = null;
    try {
      new model(doc).validate();
    } catch (e) {
      error = e.message;
    }
    console.log(JSON.stringify({ kind: doc.kind, name: doc.metadata.name, error }));
  }
})().catch((e) => { console.error(e); process.exit(2); });
