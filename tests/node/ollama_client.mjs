// Ollama's JavaScript client against a trillm server: list, show, chat whole and streamed,
// generate, a tool round trip, structured output, embed, and an unknown model's error.
// Usage: node ollama_client.mjs BASE_URL MODEL, with `ollama` in a node_modules beside it.
// Prints one JSON line with what the client returned, for the Python test to judge.
import { Ollama } from 'ollama';

const [host, model] = process.argv.slice(2);
const ollama = new Ollama({ host });
const messages = [{ role: 'user', content: 'Name three colors.' }];
const options = { temperature: 0, num_predict: 12 };

const listed = await ollama.list();
const shown = await ollama.show({ model });
const chat = await ollama.chat({ model, messages, options });
let streamed = '';
let last = null;
for await (const part of await ollama.chat({ model, messages, options, stream: true })) {
  streamed += part.message.content;
  last = part;
}
const generated = await ollama.generate({ model, prompt: 'Name three colors.', options });
const weather = {
  type: 'function',
  function: {
    name: 'get_weather', description: 'Get the current weather for a city',
    parameters: { type: 'object', properties: { city: { type: 'string', description: 'The city' } }, required: ['city'] },
  },
};
// two earlier rounds of a call and its result: after them, the small default model calls the tool itself
const shot = [
  { role: 'user', content: 'What is the weather in Paris?' },
  { role: 'assistant', content: '', tool_calls: [{ function: { name: 'get_weather', arguments: { city: 'Paris' } } }] },
  { role: 'tool', content: 'Sunny, 24 C.', tool_name: 'get_weather' },
  { role: 'assistant', content: 'It is sunny in Paris, 24 C.' },
];
const ask = [...shot, ...shot, { role: 'user', content: 'What is the weather in Tokyo?' }];
const called = await ollama.chat({ model, messages: ask, tools: [weather], options: { temperature: 0 } });
const answered = await ollama.chat({
  model, tools: [weather], options,
  messages: [...ask, called.message, { role: 'tool', content: 'Rain, 12 C.', tool_name: 'get_weather' }],
});
const schema = { type: 'object', properties: { name: { type: 'string' }, age: { type: 'integer' } }, required: ['name', 'age'] };
const person = await ollama.chat({
  model, messages: [{ role: 'user', content: 'Give me a person.' }], format: schema,
  options: { temperature: 0, num_predict: 60 },
});
const embedded = await ollama.embed({ model, input: ['red', 'green'] });
let missing = null;
try {
  await ollama.chat({ model: 'no-such-model', messages });
} catch (error) {
  missing = { name: error.name, status: error.status_code, message: error.message };
}
console.log(JSON.stringify({
  listed, details: shown.details, chat, streamed, last, generated, calls: called.message.tool_calls,
  answered: answered.message, person: JSON.parse(person.message.content),
  embedded: embedded.embeddings.map((e) => e.length), missing,
}));
