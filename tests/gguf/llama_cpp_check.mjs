// Load a GGUF in llama.cpp (through node-llama-cpp's prebuilt binary, CPU only), tokenize texts and
// generate greedily; print JSON for tests/gguf/compare_llama_cpp.py. Texts are tokenized with special tokens
// recognised, as the tokenizers library does with added tokens.
//   node llama_cpp_check.mjs model.gguf cases.json   (cases: {"texts": [...], "prompts": [[ids...]], "n": 8})
import {readFileSync} from "node:fs";
import {getLlama, LlamaLogLevel} from "node-llama-cpp";

const [modelPath, casesPath] = process.argv.slice(2);
const cases = JSON.parse(readFileSync(casesPath, "utf8"));
const llama = await getLlama({gpu: false, build: "never", logLevel: LlamaLogLevel.error});
const model = await llama.loadModel({modelPath});
const tokens = cases.texts.map((t) => Array.from(model.tokenize(t, true)));
const generated = [];
for (const prompt of cases.prompts) {
    const context = await model.createContext({contextSize: 256});
    const sequence = context.getSequence();
    const out = [];
    for await (const token of sequence.evaluate(prompt, {temperature: 0})) {
        out.push(token);
        if (out.length >= cases.n) break;
    }
    generated.push(out);
    await context.dispose();
}
console.log(JSON.stringify({tokens, generated}));
await model.dispose();
await llama.dispose();
