// llama.cpp's answers on one GGUF, for tests/test_gguf.py: token ids of texts and greedy tokens after prompts.
// It runs node-llama-cpp's prebuilt CPU binary, offline (build: "never": never download or compile llama.cpp).
//   node tests/gguf/llama_cpp_check.mjs model.gguf cases.json
//   cases.json: {"texts": ["..."], "prompts": [[1, 872, ...]], "n": 16, "chat": [{"role": "user", "content": "..."}]}
// prints one JSON line: {"tokens": [[...] per text], "generated": [[...] per prompt], "chat": "<the rendered template>",
//   "train_context": the length llama.cpp reads as the one the model was trained at}
import {readFileSync} from "node:fs";
import {getLlama, LlamaLogLevel, JinjaTemplateChatWrapper, LlamaText} from "node-llama-cpp";

const [modelPath, casesPath] = process.argv.slice(2);
const cases = JSON.parse(readFileSync(casesPath, "utf8"));
const llama = await getLlama({gpu: false, build: "never", logLevel: LlamaLogLevel.error});
const model = await llama.loadModel({modelPath});

// true: special tokens written in the text (<|im_start|>) become their ids, as the tokenizers library does
const tokens = (cases.texts ?? []).map((text) => Array.from(model.tokenize(text, true)));

const generated = [];
for (const prompt of cases.prompts ?? []) {
    const context = await model.createContext({contextSize: 256, threads: 1});  // 1: no spinning threads on a busy CPU
    const out = [];
    for await (const token of context.getSequence().evaluate(prompt, {temperature: 0})) {  // 0: greedy
        out.push(token);
        if (out.length >= cases.n) break;
    }
    generated.push(out);
    await context.dispose();
}

let chat = null;
if (cases.chat) {  // the chat template stored in the file, run by node-llama-cpp's Jinja engine
    const template = model.fileInfo.metadata.tokenizer.chat_template;
    const wrapper = new JinjaTemplateChatWrapper({template, tokenizer: model.tokenizer});
    const history = cases.chat.map((m) => m.role === "user" ? {type: "user", text: m.content}
        : m.role === "system" ? {type: "system", text: m.content} : {type: "model", response: [m.content]});
    chat = LlamaText(wrapper.generateContextState({chatHistory: history}).contextText).toString();
}

console.log(JSON.stringify({tokens, generated, chat, train_context: model.trainContextSize}));
await model.dispose();
await llama.dispose();
