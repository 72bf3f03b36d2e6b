// A JavaScript service's round trip through sluice, with KafkaJS (a Kafka client written in
// JavaScript alone): requests written with JSON.stringify, one of them a text cut inside an emoji,
// then the replies read by a consumer group until each request has its final reply.
//   node tests/kafkajs_roundtrip.cjs BOOTSTRAP REQUEST_TOPIC REPLY_TOPIC TAG
// Prints one JSON line: {"sent": {id: value}, "replies": {id: [reply, ...]}}; exits 1 on a timeout.
const { Kafka, logLevel, Partitioners } = require('kafkajs');

async function main([bootstrap, requestTopic, replyTopic, tag]) {
  const kafka = new Kafka({ clientId: 'sluice-test', brokers: [bootstrap], logLevel: logLevel.ERROR });
  const cut = 'Café 😀'.slice(0, 6); // the emoji's first UTF-16 unit only
  const requests = {
    [`${tag}-ok`]: { prompt: 'The capital of France is', max_tokens: 4 },
    [`${tag}-cut`]: { prompt: cut, max_tokens: 4 },
    [`${tag}-whole`]: { prompt: 'Café 😀 is', max_tokens: 3, stream: false },
  };
  const sent = {};
  const producer = kafka.producer({ createPartitioner: Partitioners.DefaultPartitioner });
  await producer.connect();
  const messages = Object.entries(requests).map(([id, body]) => {
    sent[id] = JSON.stringify({ id, ...body });
    return { value: sent[id] }; // no key: the id is only in the value
  });
  await producer.send({ topic: requestTopic, messages });
  await producer.disconnect();

  const replies = {};
  const finals = new Set();
  const consumer = kafka.consumer({ groupId: `${tag}-reader`, sessionTimeout: 10000, heartbeatInterval: 1000 });
  await consumer.connect();
  await consumer.subscribe({ topic: replyTopic, fromBeginning: true });
  const allFinal = new Promise((resolve) => {
    consumer.run({
      eachMessage: async ({ message }) => {
        const reply = JSON.parse(message.value.toString());
        if (!(reply.id in requests)) return;
        (replies[reply.id] ||= []).push(reply);
        if (reply.type !== 'token') finals.add(reply.id);
        if (finals.size === Object.keys(requests).length) resolve(true);
      },
    });
  });
  const inTime = await Promise.race([allFinal, new Promise((r) => setTimeout(() => r(false), 150000))]);
  await consumer.disconnect();
  console.log(JSON.stringify({ sent, replies }));
  process.exit(inTime ? 0 : 1);
}

main(process.argv.slice(2)).catch((err) => {
  console.error(err);
  process.exit(2);
});
